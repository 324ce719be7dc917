"""Datasets and partitions (fedcomp.app.data)."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcomp.app.data import (
    DataError,
    dirichlet_partition,
    iid_partition,
    load_dataset,
    load_idx_dataset,
    load_partition,
    partition_indices,
    read_idx,
)


def _mnist_dir() -> Path:
    value = os.environ.get("FEDCOMP_DATA_DIR", "")
    if not value:
        pytest.skip("FEDCOMP_DATA_DIR is not set (e.g. FEDCOMP_DATA_DIR=/work/shared/data)")
    if not (Path(value) / "mnist").is_dir():
        pytest.skip(f"FEDCOMP_DATA_DIR={value} has no mnist/ folder")
    return Path(value)


# --- digits (always available) ------------------------------------------------------------------


def test_digits_shapes_dtypes_and_split() -> None:
    ds = load_dataset("digits")
    assert ds.train.x.shape == (1500, 1, 28, 28) and ds.test.x.shape == (297, 1, 28, 28)
    assert ds.train.x.dtype == torch.float32 and ds.train.y.dtype == torch.int64
    assert set(ds.train.y.tolist()) == set(range(10)) == set(ds.test.y.tolist())
    assert abs(float(ds.train.x.mean())) < 1e-4 and abs(float(ds.train.x.std()) - 1) < 1e-4
    # MNIST-like layout: a 4-pixel empty border around the 20x20 digit.
    border = ds.train.x[:, :, :4, :]
    assert torch.allclose(border, border.flatten()[0].expand_as(border))
    assert load_dataset("digits") is ds  # cached


# --- partitions ---------------------------------------------------------------------------------


def _covers_exactly_once(parts: list[np.ndarray], n: int) -> None:
    allidx = np.concatenate(parts)
    assert len(allidx) == n
    assert np.array_equal(np.sort(allidx), np.arange(n))


@pytest.mark.parametrize("n,k", [(1500, 10), (1500, 3), (11, 11), (60000, 100)])
def test_iid_covers_every_index_once(n: int, k: int) -> None:
    parts = iid_partition(n, k, seed=1)
    _covers_exactly_once(parts, n)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    again = iid_partition(n, k, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, iid_partition(n, k, seed=2), strict=True))


@pytest.mark.parametrize("alpha", [0.1, 0.5, 100.0])
def test_dirichlet_covers_every_index_once(alpha: float) -> None:
    labels = load_dataset("digits").train.y.numpy()
    parts = dirichlet_partition(labels, 10, alpha, seed=3)
    _covers_exactly_once(parts, len(labels))
    assert min(map(len, parts)) >= 10
    again = dirichlet_partition(labels, 10, alpha, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def _label_skew(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean total-variation distance between each partition's label mix and the global one."""
    k = labels.max() + 1
    glob = np.bincount(labels, minlength=k) / len(labels)
    tv = [0.5 * np.abs(np.bincount(labels[p], minlength=k) / len(p) - glob).sum() for p in parts]
    return float(np.mean(tv))


def test_dirichlet_is_skewed_and_iid_is_not() -> None:
    labels = load_dataset("digits").train.y.numpy()
    iid = _label_skew(labels, partition_indices(labels, 10, "iid", seed=0))
    skewed = _label_skew(labels, partition_indices(labels, 10, "dirichlet", alpha=0.1, seed=0))
    mild = _label_skew(labels, partition_indices(labels, 10, "dirichlet", alpha=100.0, seed=0))
    assert iid < 0.15 and mild < 0.15
    assert skewed > 0.5 and skewed > 3 * iid
    # With alpha=0.1 most clients are dominated by a few classes.
    parts = partition_indices(labels, 10, "dirichlet", alpha=0.1, seed=0)
    top2 = [np.sort(np.bincount(labels[p], minlength=10))[-2:].sum() / len(p) for p in parts]
    assert np.median(top2) > 0.7


def test_partition_errors() -> None:
    with pytest.raises(ValueError, match="partitioning"):
        partition_indices(np.zeros(10, int), 2, "bogus")
    with pytest.raises(ValueError, match="num-partitions"):
        iid_partition(5, 6)
    with pytest.raises(ValueError, match="dirichlet-alpha"):
        dirichlet_partition(np.zeros(10, int), 2, 0.0)
    with pytest.raises(ValueError, match="partition-id"):
        load_partition("digits", 3, 3)


def test_load_partition_is_the_clients_share() -> None:
    ds = load_dataset("digits")
    parts = [load_partition("digits", i, 4, scheme="dirichlet", alpha=0.5, seed=7) for i in range(4)]
    assert sum(len(p) for p in parts) == len(ds.train)
    idx = partition_indices(ds.train.y.numpy(), 4, "dirichlet", alpha=0.5, seed=7)
    assert torch.equal(parts[2].y, ds.train.y[idx[2]])
    assert torch.equal(parts[2].x, ds.train.x[idx[2]])


# --- IDX files ----------------------------------------------------------------------------------


def _write_idx(path: Path, magic: int, shape: tuple[int, ...], payload: bytes | None = None) -> None:
    header = struct.pack(">I", magic) + struct.pack(">" + "I" * len(shape), *shape)
    if payload is None:
        payload = bytes(int(np.prod(shape)))
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wb") as f:
        f.write(header + payload)


def _fake_idx_dataset(root: Path, n_train: int = 6, n_test: int = 4) -> None:
    d = root / "mnist"
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(d / f"{split}-images-idx3-ubyte.gz", 2051, (n, 28, 28),
                   rng.integers(0, 256, n * 784, dtype=np.uint8).tobytes())  # fmt: skip
        _write_idx(d / f"{split}-labels-idx1-ubyte.gz", 2049, (n,),
                   (np.arange(n) % 10).astype(np.uint8).tobytes())  # fmt: skip


def test_idx_round_trip_on_a_tiny_fake(tmp_path: Path) -> None:
    _fake_idx_dataset(tmp_path)
    ds = load_idx_dataset("mnist", tmp_path)
    assert ds.train.x.shape == (6, 1, 28, 28) and ds.test.y.tolist() == [0, 1, 2, 3]


def test_idx_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="dataset folder not found"):
        load_idx_dataset("mnist", tmp_path)
    _fake_idx_dataset(tmp_path)
    img = tmp_path / "mnist" / "t10k-images-idx3-ubyte.gz"
    _write_idx(img, 2049, (4, 28, 28))  # label magic on an image file
    with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte\.gz: IDX magic number is 2049"):
        load_idx_dataset("mnist", tmp_path / ".")  # another path string: bypass the cache
    _write_idx(img, 2051, (4, 28, 28), bytes(100))  # truncated
    with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte\.gz: IDX header says"):
        read_idx(img, 2051)
    img.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte\.gz: not a readable gzip"):
        read_idx(img, 2051)
    img.unlink()
    with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte\.gz: file not found"):
        read_idx(img)


def test_missing_data_dir_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDCOMP_DATA_DIR", raising=False)
    with pytest.raises(DataError, match="FEDCOMP_DATA_DIR"):
        load_dataset("mnist")
    with pytest.raises(DataError, match="unknown dataset"):
        load_dataset("cifar10")


# --- real MNIST / Fashion-MNIST (need FEDCOMP_DATA_DIR) ------------------------------------------


def test_mnist_real_files() -> None:
    ds = load_idx_dataset("mnist", _mnist_dir())
    assert ds.train.x.shape == (60000, 1, 28, 28) and ds.test.x.shape == (10000, 1, 28, 28)
    assert ds.train.x.dtype == torch.float32 and ds.train.y.dtype == torch.int64
    assert ds.train.y[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert ds.test.y[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    assert abs(float(ds.train.x.mean())) < 1e-3 and abs(float(ds.train.x.std()) - 1) < 1e-3
    parts = partition_indices(ds.train.y, 100, "dirichlet", alpha=0.5, seed=0)
    _covers_exactly_once(parts, 60000)


def test_fashion_mnist_real_files() -> None:
    root = _mnist_dir()
    if not (root / "fashion-mnist").is_dir():
        pytest.skip(f"{root} has no fashion-mnist/ folder")
    ds = load_dataset("fashion-mnist", root)
    assert len(ds.train) == 60000 and len(ds.test) == 10000
    assert np.bincount(ds.test.y.numpy()).tolist() == [1000] * 10


def test_env_var_is_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    root = _mnist_dir()
    monkeypatch.setenv("FEDCOMP_DATA_DIR", str(root))
    assert len(load_dataset("mnist").test) == 10000


# --- tiny Shakespeare (needs FEDCOMP_DATA_DIR) ------------------------------------------------------


def _shakespeare_dir() -> Path:
    root = _mnist_dir()
    if not (root / "tinyshakespeare" / "input.txt").is_file():
        pytest.skip(f"{root} has no tinyshakespeare/input.txt")
    return root


def test_shakespeare_windows_their_next_byte_and_a_test_text_never_trained_on() -> None:
    from fedcomp.app.data import SHAKESPEARE_SEQ, load_shakespeare_dataset

    root = _shakespeare_dir()
    text = (root / "tinyshakespeare" / "input.txt").read_bytes()
    ds = load_shakespeare_dataset(root)
    assert ds.num_classes == 256 and ds.train.x.dtype == torch.uint8 and ds.train.y.dtype == torch.int64
    cut = int(len(text) * 0.9)
    assert len(ds.train) == len(range(0, cut - SHAKESPEARE_SEQ, 20)) == 50_189
    assert len(ds.test) == len(range(cut, len(text) - SHAKESPEARE_SEQ, SHAKESPEARE_SEQ)) == 1_394
    for split, starts in ((ds.train, [0, 20, 20 * 50_188]), (ds.test, [cut, cut + 80, cut + 80 * 1_393])):
        for i, start in enumerate(starts):
            j = [0, 1, len(split) - 1][i]
            assert bytes(split.x[j].tolist()) == text[start : start + SHAKESPEARE_SEQ]
            assert int(split.y[j]) == text[start + SHAKESPEARE_SEQ]
    assert cut > 20 * 50_188 + SHAKESPEARE_SEQ  # the last training label lies before the test text
    assert bytes(ds.train.x[0].tolist()).startswith(b"First Citizen:")
    parts = partition_indices(ds.train.y, 10, "dirichlet", alpha=0.3, seed=0)
    _covers_exactly_once(parts, len(ds.train))
    assert load_partition("shakespeare", 2, 4, data_dir=root).x.shape[1:] == (SHAKESPEARE_SEQ,)


def test_shakespeare_errors_name_the_file(tmp_path: Path) -> None:
    from fedcomp.app.data import load_shakespeare_dataset

    with pytest.raises(DataError, match=r"tinyshakespeare/input\.txt: not found"):
        load_shakespeare_dataset(tmp_path)
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_bytes(b"x" * 100)
    with pytest.raises(DataError, match="100 bytes, too short for windows of 80"):
        load_shakespeare_dataset(tmp_path)


def test_the_char_lstm_learns_the_next_byte() -> None:
    """The Shakespeare model (the SBC paper's CharLSTM) on real text: 20 Adam steps take the
    test loss from the uniform guess's ln(256) = 5.55 to below 4.5."""
    from fedcomp.app.models import CharLSTM, evaluate, model_for, train_local

    ds = load_dataset("shakespeare", _shakespeare_dir())
    torch.manual_seed(0)
    model = model_for("shakespeare")
    assert isinstance(model, CharLSTM) and sum(p.numel() for p in model.parameters()) == 543_104
    before, _ = evaluate(model, ds.test.x[:300], ds.test.y[:300])
    train_local(model, (ds.train.x[:2000], ds.train.y[:2000]), 20, lr=0.02, generator=torch.Generator().manual_seed(0))
    after, _ = evaluate(model, ds.test.x[:300], ds.test.y[:300])
    assert before > 5.0 and after < 4.5, (before, after)
