"""The pending update a client keeps until it learns its outcome: exact round trip, the memory
bound (at most the model's float32 size, ~8 bytes per sent entry when sparse), and typed errors
for a record that is not this model's."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord

from fedcomp.codecs import TensorSpec
from fedcomp.errors import PayloadError
from fedcomp.flower.pending import PendingUpdate
from fedcomp.methods.sent import KeptValues
from fedcomp.methods.sent import dense as to_dense
from fedcomp.methods.update import specs_of


def _sparse(numel: int, nnz: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.zeros(numel)
    t[torch.randperm(numel, generator=g)[:nnz]] = torch.randn(nnz, generator=g)
    return t


def _stored_bytes(rec: ConfigRecord) -> int:
    return sum(len(v) for v in rec.values() if isinstance(v, bytes))


def test_a_pending_update_round_trips_exactly_sparse_dense_and_odd_shapes() -> None:
    tensors = {
        "w": _sparse(4000, 40).reshape(40, 100),
        "b": torch.randn(10),  # dense: every entry sent
        "s": torch.tensor(2.5),  # a scalar
        "e": torch.zeros(0, 3),  # no elements
        "z": torch.zeros(50),  # nothing sent
    }
    rec = PendingUpdate(4, tensors).to_record()
    assert "positions:w" in rec and "dense:b" in rec and "dense:s" in rec and "positions:z" in rec
    back = PendingUpdate.from_record(rec, specs_of(tensors))
    assert back.round == 4 and list(back.tensors) == list(tensors)
    for k, t in tensors.items():
        assert back.tensors[k].shape == t.shape and torch.equal(back.tensors[k], t), k


def test_the_memory_bound() -> None:
    # Sparse: 4-byte positions and 4-byte values per sent entry.
    rec = PendingUpdate(1, {"w": _sparse(100_000, 1000)}).to_record()
    assert _stored_bytes(rec) == 1000 * 8
    # Never more than the dense float32 size, however dense the update.
    for nnz in (49_999, 50_000, 100_000):
        rec = PendingUpdate(1, {"w": _sparse(100_000, nnz)}).to_record()
        assert _stored_bytes(rec) <= 100_000 * 4, nnz


def test_without_specs_the_record_describes_itself() -> None:
    tensors = {"a": _sparse(300, 3).reshape(3, 100)}
    back = PendingUpdate.from_record(PendingUpdate(2, tensors).to_record())
    assert torch.equal(back.tensors["a"], tensors["a"])


def _good() -> dict[str, Any]:
    return dict(PendingUpdate(3, {"w": _sparse(1000, 5), "b": torch.ones(4)}).to_record())


SPECS = [TensorSpec("w", (1000,)), TensorSpec("b", (4,))]


@pytest.mark.parametrize(
    ("change", "tensor", "message"),
    [
        ({"round": -1}, "", "field 'round' is -1, not a round number"),
        ({"round": True}, "", "field 'round' is True, not a round number"),
        ({"round": None}, "", "field 'round' is None, not a round number"),
        ({"names": ["w", "w"]}, "", "field 'names' is not a list of distinct names"),
        ({"names": "w"}, "", "field 'names' is not a list of distinct names"),
        ({"shape:b": [-4]}, "b", "the tensor's shape is missing or malformed"),
        ({"shape:b": None}, "b", "the tensor's shape is missing or malformed"),
        ({"dense:b": b"\x00" * 15}, "b", "the stored torch.float32 data has the wrong size"),
        ({"positions:w": None}, "w", "the tensor's data is missing"),
        ({"positions:w": b"\xff" * 20}, "w", "a position is outside the tensor"),
        ({"positions:w": b"\x00" * 16}, "w", "the stored torch.int32 data has the wrong size"),
        ({"extra": 1}, "", "unexpected field(s) ['extra']"),
    ],
)
def test_a_malformed_record_is_a_payload_error(change: dict[str, Any], tensor: str, message: str) -> None:
    rec = _good()
    for k, v in change.items():
        if v is None:
            rec.pop(k)
        else:
            rec[k] = v
    with pytest.raises(PayloadError) as info:
        PendingUpdate.from_record(rec, SPECS)
    assert info.value.tensor == tensor and str(info.value).endswith(f"pending update: {message}")


def test_a_record_of_another_model_is_refused() -> None:
    with pytest.raises(PayloadError, match="its tensors are not the model's"):
        PendingUpdate.from_record(_good(), [TensorSpec("w", (1000,)), TensorSpec("b", (5,))])
    with pytest.raises(PayloadError, match="its tensors are not the model's"):
        PendingUpdate.from_record(_good(), [TensorSpec("w", (1000,))])


@pytest.mark.parametrize(
    ("shape", "count", "value"),
    [
        ((40, 100), 40, 0.75),  # sparse
        ((4000,), 2500, -1e-3),  # more than half: dense is smaller
        ((10,), 0, 0.0),  # nothing kept
        ((30,), 5, -0.0),  # a value of -0.0: zeros, as the dense tensor's non-zeros say
        ((), 1, 2.0),  # a scalar
        ((0, 3), 0, 1.0),  # no elements
        ((40, 100), 40, "values"),  # one value per position (STC, top-k), a few of them zero
    ],
)
def test_kept_values_write_the_record_of_their_dense_tensor(
    shape: tuple[int, ...], count: int, value: float | str
) -> None:
    g = torch.Generator().manual_seed(count)
    numel = math.prod(shape)
    positions = torch.randperm(numel, generator=g)[:count].sort().values.numpy()
    values: float | np.ndarray = float(value) if not isinstance(value, str) else torch.randn(count, generator=g).numpy()
    if isinstance(values, np.ndarray):
        values[::7] = 0.0  # (a float16 value that underflowed: sent, decoded as zero)
    kept = KeptValues(shape, positions, values)
    tensors = {"before": torch.randn(20, generator=g), "kept": kept, "after": _sparse(3000, 30)}
    dense = {**tensors, "kept": to_dense(kept)}
    rec = PendingUpdate(3, tensors).to_record()
    assert rec == PendingUpdate(3, dense).to_record()
    assert list(rec) == list(PendingUpdate(3, dense).to_record())  # the same fields in the same order
    back = PendingUpdate.from_record(rec, specs_of(dense))
    assert all(torch.equal(back.tensors[k], t) for k, t in dense.items())
    assert all(torch.equal(PendingUpdate(3, tensors).dense_tensors()[k], t) for k, t in dense.items())
