"""mnistquick: the model, MNIST from the data folder, and the train/test loops."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """The quickstart's small CNN, for 1 x 28 x 28 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def _read(path: Path, offset: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=offset)


def _mnist(split: str, data_dir: str) -> TensorDataset:
    root = Path(data_dir or os.environ.get("FEDCOMP_DATA_DIR", "")) / "mnist"
    prefix = "train" if split == "train" else "t10k"
    images = _read(root / f"{prefix}-images-idx3-ubyte.gz", 16).reshape(-1, 1, 28, 28)
    labels = _read(root / f"{prefix}-labels-idx1-ubyte.gz", 8)
    x = (torch.from_numpy(images.astype(np.float32)) / 255.0 - 0.1307) / 0.3081
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


def load_data(partition_id: int, num_partitions: int, batch_size: int, data_dir: str, seed: int) -> DataLoader:
    """This partition of the MNIST training set (IID: a seeded shuffle cut into equal parts)."""
    train = _mnist("train", data_dir)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    part = order[partition_id::num_partitions]
    g = torch.Generator().manual_seed(seed * 1_000 + partition_id)
    return DataLoader(torch.utils.data.Subset(train, part.tolist()), batch_size=batch_size, shuffle=True, generator=g)


def load_centralized_dataset(data_dir: str) -> DataLoader:
    return DataLoader(_mnist("test", data_dir), batch_size=512)


def train(net: nn.Module, loader: DataLoader, epochs: int, lr: float) -> float:
    """Local SGD with momentum, as in the quickstart; returns the mean training loss."""
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    total, batches = 0.0, 0
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(net(x), y)
            loss.backward()
            optimizer.step()
            total, batches = total + float(loss), batches + 1
    return total / max(1, batches)


def test(net: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """Loss and accuracy on ``loader``."""
    criterion = nn.CrossEntropyLoss(reduction="sum")
    net.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            out = net(x)
            loss += float(criterion(out, y))
            correct += int((out.argmax(1) == y).sum())
            n += len(y)
    return loss / n, correct / n
