"""Datasets as torch tensors, and how they are split over simulated clients.

Every dataset comes out as a :class:`Split`: float32 images ``N x 1 x 28 x 28``, normalized with the
training set's mean and std (text: uint8 byte windows ``N x L``), and int64 labels.

* ``"mnist"`` and ``"fashion-mnist"`` read the four published gzip IDX files from
  ``<data_dir>/<name>/`` (:func:`load_idx_dataset`). Nothing is downloaded; the data folder comes
  from the run config or ``$FEDCOMP_DATA_DIR``.
* ``"digits"`` is scikit-learn's bundled 8x8 handwritten digits (1,797 images, shipped inside the
  package, so it works offline with no data folder). Each image is upsampled to 20x20 and padded
  to 28x28, the way MNIST centers its 20x20 digits, so the same LeNet5 runs on it. A fixed
  permutation splits it into 1,500 train and 297 test images.
* ``"shakespeare"`` is tiny Shakespeare (``<data_dir>/tinyshakespeare/input.txt``, 1,115,394
  characters) as next-character prediction, the task of LEAF's Shakespeare benchmark and of the
  SBC paper's CharLSTM: each sample is :data:`SHAKESPEARE_SEQ` characters (uint8 bytes) and its
  label the byte that follows. The first 90 % of the text gives the training samples (a window
  every :data:`SHAKESPEARE_STRIDE` characters), the rest the test samples (windows that do not
  overlap), so no test character is ever trained on. Departure from the SBC paper, which gives each
  of four clients a contiguous quarter of the complete works: the samples are partitioned like
  the images (IID, or Dirichlet over the next character).

Partitioning (:func:`partition_indices`) is IID (a seeded shuffle cut into near-equal parts) or
Dirichlet(alpha) non-IID (per class, a Dirichlet draw over the clients says which share of that
class each client gets; small alpha = strong label skew). Both are deterministic in ``seed`` and
cover every training index exactly once.

Why not flwr-datasets' ``IidPartitioner``/``DirichletPartitioner``: they do work offline on an
in-memory ``datasets.Dataset.from_dict`` (checked with flwr-datasets 0.6.1), but installing them
pulls ~18 packages (HF ``datasets``, ``pyarrow``, ``pandas``, ``huggingface_hub``, ``aiohttp``,
``seaborn``, ...; ~300 MB), upgrades ``click`` under flwr's CLI, and the import takes ~4 s in every
simulated client process. The two partitioners below are ~50 lines of numpy with the same
semantics (the Dirichlet one also redraws until every client has ``min_partition_size`` samples).

Caching: decoded datasets and partitions are kept per process (``functools.lru_cache``); a
simulated client process (a Ray actor) serves many rounds and clients, so MNIST is decoded once per
process, not once per round. Decoding all of MNIST takes well under a second, so there is no
on-disk cache.
"""

from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedcomp.app.config import DATA_DIR_ENV

__all__ = [
    "DATASETS",
    "IDX_DATASETS",
    "SHAKESPEARE_CLASSES",
    "SHAKESPEARE_SEQ",
    "DataError",
    "Dataset",
    "Split",
    "dirichlet_partition",
    "iid_partition",
    "load_dataset",
    "load_digits_dataset",
    "load_idx_dataset",
    "load_partition",
    "load_shakespeare_dataset",
    "partition_indices",
    "read_idx",
    "resolve_data_dir",
]

IDX_DATASETS = ("mnist", "fashion-mnist")
DATASETS = ("digits", *IDX_DATASETS, "shakespeare")

#: Characters a Shakespeare sample holds (LEAF's length), a training window every this many
#: characters, and the share of the text, at its end, kept for testing.
SHAKESPEARE_SEQ = 80
SHAKESPEARE_STRIDE = 20
SHAKESPEARE_TEST_SHARE = 0.1
#: Classes of the Shakespeare task: every byte value (the text's 65 characters among them), so the
#: model does not depend on the file.
SHAKESPEARE_CLASSES = 256

_IDX_FILES = {
    ("train", "images"): "train-images-idx3-ubyte.gz",
    ("train", "labels"): "train-labels-idx1-ubyte.gz",
    ("test", "images"): "t10k-images-idx3-ubyte.gz",
    ("test", "labels"): "t10k-labels-idx1-ubyte.gz",
}
_IMAGE_MAGIC, _LABEL_MAGIC = 2051, 2049

DIGITS_TRAIN_SIZE = 1500  # of 1,797; the remaining 297 are the test set
_DIGITS_SPLIT_SEED = 0


class DataError(RuntimeError):
    """A dataset could not be found or read; the message names the file or setting."""


@dataclass(frozen=True)
class Split:
    """One split of a dataset: ``x`` float32 ``N x 1 x 28 x 28`` normalized (Shakespeare: uint8
    ``N x SHAKESPEARE_SEQ``), ``y`` int64 ``N``."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, indices: np.ndarray | torch.Tensor) -> Split:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return Split(self.x[idx], self.y[idx])


@dataclass(frozen=True)
class Dataset:
    name: str
    train: Split
    test: Split
    num_classes: int = 10


# --- IDX (MNIST, Fashion-MNIST) -----------------------------------------------------------------


def read_idx(path: str | Path, expected_magic: int | None = None) -> np.ndarray:
    """Read one gzip-compressed IDX file (unsigned-byte data) into a uint8 array.

    Raises :class:`DataError` naming the file when it is missing, not gzip, has the wrong magic
    number, or is shorter or longer than its header says.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as err:
        raise DataError(f"{path}: not a readable gzip file ({err})") from None
    if len(data) < 4:
        raise DataError(f"{path}: too short for an IDX header ({len(data)} bytes)")
    magic = struct.unpack(">I", data[:4])[0]
    if expected_magic is not None and magic != expected_magic:
        raise DataError(f"{path}: IDX magic number is {magic}, expected {expected_magic}")
    if data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise DataError(f"{path}: not an unsigned-byte IDX file (magic {magic})")
    ndim = data[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(data) < header:
        raise DataError(f"{path}: truncated IDX header")
    shape = struct.unpack(">" + "I" * ndim, data[4:header])
    expected = int(np.prod(shape))
    if len(data) - header != expected:
        raise DataError(
            f"{path}: IDX header says shape {shape} ({expected} bytes of data) but the file holds {len(data) - header}"
        )
    return np.frombuffer(data, np.uint8, offset=header).reshape(shape)


def resolve_data_dir(data_dir: str | Path | None = None) -> Path:
    """``data_dir`` if given and non-empty, else ``$FEDCOMP_DATA_DIR``; raise if neither is set."""
    value = str(data_dir) if data_dir else os.environ.get(DATA_DIR_ENV, "")
    if not value:
        raise DataError(
            f"no data folder: set the run config key 'data-dir' or the {DATA_DIR_ENV} "
            "environment variable to the folder holding mnist/, fashion-mnist/ and tinyshakespeare/ "
            "(or use dataset='digits', which needs no files)"
        )
    return Path(value).expanduser()


def _normalize(images_u8: np.ndarray, mean: float, std: float) -> torch.Tensor:
    x = torch.from_numpy(images_u8.astype(np.float32)).div_(255.0)
    return x.sub_(mean).div_(std).unsqueeze(1)


def _idx_folder(root: Path, name: str) -> Path:
    """``root/name``, the folder of an IDX dataset (raises :class:`DataError` when it is not one)."""
    folder = root / name
    if not folder.is_dir():
        raise DataError(f"{folder}: dataset folder not found (expected the four IDX .gz files)")
    return folder


def _shakespeare_file(root: Path) -> Path:
    """Tiny Shakespeare's ``input.txt`` under ``root`` (raises :class:`DataError` when absent)."""
    path = root / "tinyshakespeare" / "input.txt"
    if not path.is_file():
        raise DataError(f"{path}: not found (tiny Shakespeare's input.txt)")
    return path


@lru_cache(maxsize=4)
def _load_idx_cached(name: str, root: str) -> Dataset:
    folder = _idx_folder(Path(root), name)
    raw: dict[tuple[str, str], np.ndarray] = {}
    for (split, kind), fname in _IDX_FILES.items():
        magic = _IMAGE_MAGIC if kind == "images" else _LABEL_MAGIC
        raw[split, kind] = read_idx(folder / fname, magic)
    for split in ("train", "test"):
        images, labels = raw[split, "images"], raw[split, "labels"]
        if images.ndim != 3 or images.shape[1:] != (28, 28):
            raise DataError(f"{folder / _IDX_FILES[split, 'images']}: images are not 28x28")
        if labels.ndim != 1 or len(labels) != len(images):
            raise DataError(f"{folder / _IDX_FILES[split, 'labels']}: {len(labels)} labels for {len(images)} images")
        if labels.size and labels.max() > 9:
            raise DataError(f"{folder / _IDX_FILES[split, 'labels']}: label > 9")
    train_u8 = raw["train", "images"]
    mean = float(train_u8.mean()) / 255.0
    std = float(train_u8.std()) / 255.0
    return Dataset(
        name=name,
        train=Split(
            _normalize(train_u8, mean, std),
            torch.from_numpy(raw["train", "labels"].astype(np.int64)),
        ),
        test=Split(
            _normalize(raw["test", "images"], mean, std),
            torch.from_numpy(raw["test", "labels"].astype(np.int64)),
        ),
    )


def load_idx_dataset(name: str, data_dir: str | Path | None = None) -> Dataset:
    """MNIST or Fashion-MNIST from ``<data_dir>/<name>/*.gz`` (data_dir: argument or env var)."""
    if name not in IDX_DATASETS:
        raise DataError(f"dataset: unknown IDX dataset {name!r}; known: {list(IDX_DATASETS)}")
    root = resolve_data_dir(data_dir).resolve()
    return _load_idx_cached(name, str(root))


# --- scikit-learn digits ------------------------------------------------------------------------


@lru_cache(maxsize=1)
def load_digits_dataset() -> Dataset:
    """scikit-learn's 8x8 digits, upsampled and padded to 28x28, split 1500/297 (fixed)."""
    from sklearn.datasets import load_digits  # local import: sklearn is slow to import

    bunch = load_digits()
    images = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)  # N,1,8,8
    images = F.interpolate(images, size=(20, 20), mode="bilinear", align_corners=False)
    images = F.pad(images, (4, 4, 4, 4)).clamp_(0.0, 1.0)  # N,1,28,28 like MNIST
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    perm = torch.from_numpy(np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(len(labels)))
    train_idx, test_idx = perm[:DIGITS_TRAIN_SIZE], perm[DIGITS_TRAIN_SIZE:]
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    return Dataset(
        name="digits",
        train=Split(images[train_idx].contiguous(), labels[train_idx].contiguous()),
        test=Split(images[test_idx].contiguous(), labels[test_idx].contiguous()),
    )


# --- tiny Shakespeare ---------------------------------------------------------------------------


def load_shakespeare_dataset(data_dir: str | Path | None = None) -> Dataset:
    """Tiny Shakespeare from ``<data_dir>/tinyshakespeare/input.txt`` as next-byte prediction (see
    the module doc)."""
    return _load_shakespeare_cached(str(resolve_data_dir(data_dir).resolve()))


@lru_cache(maxsize=2)
def _load_shakespeare_cached(root: str) -> Dataset:
    path = _shakespeare_file(Path(root))
    text = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    cut = int(len(text) * (1.0 - SHAKESPEARE_TEST_SHARE))
    if cut - SHAKESPEARE_SEQ < 1 or len(text) - cut <= SHAKESPEARE_SEQ:
        raise DataError(f"{path}: {len(text)} bytes, too short for windows of {SHAKESPEARE_SEQ}")

    def windows(starts: np.ndarray) -> Split:
        x = text[starts[:, None] + np.arange(SHAKESPEARE_SEQ)]  # (the label is the byte after)
        return Split(
            torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(text[starts + SHAKESPEARE_SEQ].astype(np.int64))
        )

    # a training window ends, label included, before the cut; test windows start at it
    train = windows(np.arange(0, cut - SHAKESPEARE_SEQ, SHAKESPEARE_STRIDE))
    test = windows(np.arange(cut, len(text) - SHAKESPEARE_SEQ, SHAKESPEARE_SEQ))
    return Dataset(name="shakespeare", train=train, test=test, num_classes=SHAKESPEARE_CLASSES)


def check_dataset_files(name: str, data_dir: str | Path | None = None) -> None:
    """Raise :class:`DataError` (the message names the folder, file or setting) when ``name``'s
    files are not there, without reading them: what a command checks before it starts a run
    whose clients would each fail on it."""
    if name == "digits":
        return
    root = resolve_data_dir(data_dir).expanduser()
    if name in IDX_DATASETS:
        folder = _idx_folder(root, name)
        for fname in _IDX_FILES.values():
            if not (folder / fname).is_file():
                raise DataError(f"{folder / fname}: not found")
    elif name == "shakespeare":
        _shakespeare_file(root)
    else:
        raise DataError(f"dataset: unknown dataset {name!r}; known: {list(DATASETS)}")


def load_dataset(name: str, data_dir: str | Path | None = None) -> Dataset:
    """Any of :data:`DATASETS`. ``data_dir`` is only used (and only needed) for the ones read from
    files (all but digits)."""
    if name == "digits":
        return load_digits_dataset()
    if name in IDX_DATASETS:
        return load_idx_dataset(name, data_dir)
    if name == "shakespeare":
        return load_shakespeare_dataset(data_dir)
    raise DataError(f"dataset: unknown dataset {name!r}; known: {list(DATASETS)}")


# --- partitioning -------------------------------------------------------------------------------


def iid_partition(num_samples: int, num_partitions: int, seed: int = 0) -> list[np.ndarray]:
    """Shuffle ``range(num_samples)`` with ``seed`` and cut it into near-equal parts."""
    _check_partitions(num_samples, num_partitions)
    perm = np.random.default_rng(seed).permutation(num_samples)
    return [np.sort(p) for p in np.array_split(perm, num_partitions)]


def dirichlet_partition(
    labels: np.ndarray | torch.Tensor,
    num_partitions: int,
    alpha: float,
    seed: int = 0,
    min_partition_size: int | None = None,
    max_attempts: int = 100,
) -> list[np.ndarray]:
    """Label-skewed partition: for each class, Dirichlet(alpha) shares over the partitions.

    Redraws (up to ``max_attempts`` times) until every partition has at least
    ``min_partition_size`` samples (default: ``min(10, N // (2 * num_partitions))``); raises
    ``ValueError`` when that cannot be met, suggesting a larger alpha or fewer partitions.
    """
    labels = np.asarray(labels)
    n = len(labels)
    _check_partitions(n, num_partitions)
    if alpha <= 0:
        raise ValueError(f"dirichlet-alpha: must be > 0 (got {alpha})")
    if min_partition_size is None:
        min_partition_size = min(10, n // (2 * num_partitions))
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_attempts):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(num_partitions, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).round().astype(int)
            for p, chunk in enumerate(np.split(idx, cuts)):
                parts[p].append(chunk)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in out) >= min_partition_size:
            return out
    raise ValueError(
        f"dirichlet partition: could not give each of {num_partitions} partitions "
        f">= {min_partition_size} samples in {max_attempts} draws with alpha={alpha}; "
        "use a larger dirichlet-alpha or fewer clients"
    )


def _check_partitions(num_samples: int, num_partitions: int) -> None:
    if num_partitions < 1:
        raise ValueError(f"num-partitions: must be >= 1 (got {num_partitions})")
    if num_partitions > num_samples:
        raise ValueError(f"num-partitions: {num_partitions} partitions for {num_samples} samples")


def partition_indices(
    labels: np.ndarray | torch.Tensor,
    num_partitions: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
) -> list[np.ndarray]:
    """Split the indices of ``labels`` by ``scheme`` ("iid" | "dirichlet")."""
    if scheme == "iid":
        return iid_partition(len(labels), num_partitions, seed)
    if scheme == "dirichlet":
        return dirichlet_partition(labels, num_partitions, alpha, seed)
    raise ValueError(f"partitioning: unknown scheme {scheme!r}; known: ['iid', 'dirichlet']")


@lru_cache(maxsize=8)
def _partition_cached(
    name: str, root: str, num_partitions: int, scheme: str, alpha: float, seed: int
) -> tuple[np.ndarray, ...]:
    ds = load_dataset(name, root or None)
    return tuple(partition_indices(ds.train.y.numpy(), num_partitions, scheme, alpha, seed))


def load_partition(
    name: str,
    partition_id: int,
    num_partitions: int,
    *,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    data_dir: str | Path | None = None,
) -> Split:
    """The training samples of client ``partition_id`` out of ``num_partitions``."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id: {partition_id} not in [0, {num_partitions})")
    root = "" if name == "digits" else str(resolve_data_dir(data_dir).resolve())
    parts = _partition_cached(name, root, num_partitions, scheme, float(alpha), seed)
    return load_dataset(name, root or None).train.subset(parts[partition_id])
