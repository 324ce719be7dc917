"""mnistquick: a Flower / PyTorch app in the style of Flower's quickstart."""
