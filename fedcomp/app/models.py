"""The models of the SBC paper's MNIST and Shakespeare experiments, local training, and evaluation."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedcomp.errors import ConfigError

__all__ = [
    "MODELS",
    "CharLSTM",
    "LeNet5Caffe",
    "evaluate",
    "flushing_denormals",
    "model_for",
    "resolve_device",
    "state_dict_nbytes",
    "train_local",
]


class LeNet5Caffe(nn.Module):
    """Caffe's LeNet-5 (used by Sattler et al., SBC, for MNIST): 431,080 parameters.

    conv 1->20 5x5, maxpool 2, conv 20->50 5x5, maxpool 2, fc 800->500, ReLU, fc 500->10.
    Input ``N x 1 x 28 x 28``, output logits ``N x 10``. As in Caffe, the convolutions have no
    nonlinearity.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, kernel_size=5)
        self.conv2 = nn.Conv2d(20, 50, kernel_size=5)
        self.fc1 = nn.Linear(800, 500)
        self.fc2 = nn.Linear(500, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(self.conv1(x), 2)  # 20 x 12 x 12
        x = F.max_pool2d(self.conv2(x), 2)  # 50 x 4 x 4
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


class CharLSTM(nn.Module):
    """The SBC paper's CharLSTM (Sattler et al., Shakespeare: a two-layer LSTM of 200 units) for
    next-byte prediction: an 8-wide byte embedding, the LSTM, and logits over ``num_classes``
    bytes from its last step. Input ``N x L`` byte codes (uint8 or int64), output ``N x
    num_classes``. 543,104 parameters with 256 classes."""

    def __init__(self, num_classes: int = 256, embedding: int = 8, hidden: int = 200, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(num_classes, embedding)
        self.lstm = nn.LSTM(embedding, hidden, layers, batch_first=True)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x.long()))
        return self.fc(out[:, -1])


#: The reference app's datasets, each with the model that trains on it.
MODELS: dict[str, type[nn.Module]] = {
    "digits": LeNet5Caffe,
    "mnist": LeNet5Caffe,
    "fashion-mnist": LeNet5Caffe,
    "shakespeare": CharLSTM,
}


def model_for(dataset: str) -> nn.Module:
    """The reference app's model for ``dataset``: CharLSTM for "shakespeare", LeNet5Caffe for the
    images; a :class:`ConfigError` naming the key for any other name (a ClientApp reads the run
    config without the server's validation: it must not build LeNet for a typo)."""
    if dataset not in MODELS:
        raise ConfigError(f"dataset: must be one of {', '.join(map(repr, MODELS))} (got {dataset!r})")
    return MODELS[dataset]()


def state_dict_nbytes(model: nn.Module) -> int:
    """Bytes of all tensors in the state dict as stored (fp32 model: 4 x #params)."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Map "auto" to cuda when available, else cpu; pass anything else to torch.device."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]


def _tensor_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, generator: torch.Generator | None) -> Batches:
    """Endless shuffled minibatches of (x, y); reshuffles at the end of every epoch."""
    n = len(y)
    if n == 0:
        raise ValueError("train_local: no training samples")
    batch_size = min(batch_size, n)
    while True:
        perm = torch.randperm(n, generator=generator)
        for start in range(0, n - batch_size + 1, batch_size):  # drop the ragged last batch
            idx = perm[start : start + batch_size]
            yield x[idx], y[idx]


def _cycle(loader: Batches) -> Batches:
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch[0], batch[1]
        if empty:
            raise ValueError("train_local: the data loader yielded no batches")


@contextlib.contextmanager
def flushing_denormals() -> Iterator[None]:
    """Subnormal floats flushed to zero by this thread's arithmetic inside (then back to torch's
    default, not flushed). A trained LSTM's saturated gates make its backward pass produce them,
    and a CPU computes with them many times slower: on the Shakespeare CharLSTM after 24 rounds a
    training step took 675 ms against 97 ms flushed (one core). Only the reference app's training
    and evaluation run inside; the codecs never do (they must read subnormal values exactly)."""
    flushed = torch.set_flush_denormal(True)  # (False where the CPU cannot)
    try:
        yield
    finally:
        if flushed:
            torch.set_flush_denormal(False)


def train_local(
    model: nn.Module,
    data: tuple[torch.Tensor, torch.Tensor] | Batches,
    iterations: int,
    lr: float,
    optimizer: Literal["adam", "sgd"] = "adam",
    device: str | torch.device = "cpu",
    *,
    batch_size: int = 32,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    generator: torch.Generator | None = None,
) -> float:
    """Run exactly ``iterations`` minibatch steps on ``data`` and return the mean training loss.

    ``data`` is either a tuple ``(x, y)`` of tensors (shuffled minibatches of ``batch_size``,
    reshuffled each epoch with ``generator``) or any iterable of ``(x, y)`` batches such as a
    ``DataLoader``; both are cycled until ``iterations`` steps have run. A fresh optimizer is made
    per call (no optimizer state is carried between federated rounds).
    """
    if iterations < 1:
        raise ValueError(f"local-iters: must be >= 1 (got {iterations})")
    device = resolve_device(device)
    model.to(device).train()
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    else:
        raise ValueError(f"optimizer: must be 'adam' or 'sgd' (got {optimizer!r})")

    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], torch.Tensor):
        batches = _tensor_batches(data[0], data[1], batch_size, generator)
    else:
        batches = _cycle(data)

    total = torch.zeros((), device=device)
    with flushing_denormals():
        for xb, yb in itertools.islice(batches, iterations):  # both sources are endless
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            total += loss.detach()
    return float(total) / iterations


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    device: str | torch.device = "cpu",
    batch_size: int = 1000,
) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``model`` on ``(x, y)``."""
    device = resolve_device(device)
    model.to(device).eval()
    n = len(y)
    if n == 0:
        raise ValueError("evaluate: empty test set")
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros((), device=device, dtype=torch.long)
    with flushing_denormals():
        for start in range(0, n, batch_size):
            xb = x[start : start + batch_size].to(device)
            yb = y[start : start + batch_size].to(device)
            logits = model(xb)
            loss_sum += F.cross_entropy(logits, yb, reduction="sum").double()
            correct += (logits.argmax(1) == yb).sum()
    return float(loss_sum) / n, int(correct) / n
