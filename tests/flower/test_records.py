"""records.py's own Array bytes (``npy_array``) and reader (``array_values``): what Flower's
``Array(ndarray)`` and ``Array.numpy()`` give, byte for byte and value for value, for every kind
of array a model or a user's app may put in a record, and the same outcome for data ``np.load``
would refuse or read otherwise."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fedcomp.flower.records import (
    SQUARES_PIECE,
    array_values,
    not_finite_and_norm,
    npy_array,
    record_from_tensors,
    sum_of_squares,
    tensors_from_record,
)
from fedcomp.methods.sent import KeptValues
from fedcomp.methods.sent import dense as to_dense

_rng = np.random.default_rng(7)

ARRAYS: dict[str, Callable[[], np.ndarray]] = {
    "float32 matrix": lambda: _rng.standard_normal((5, 7)).astype(np.float32),
    "float32 0-d": lambda: np.array(3.5, dtype=np.float32),
    "float32 empty": lambda: np.zeros((0,), np.float32),
    "int64 empty 3-d": lambda: np.zeros((3, 0, 2), np.int64),
    "float16": lambda: np.arange(12, dtype=np.float16).reshape(3, 4),
    "float64": lambda: _rng.standard_normal((2, 3, 4)),
    "bool": lambda: np.array([True, False, True]),
    "uint8": lambda: np.arange(6, dtype=np.uint8),
    "int32 strided view": lambda: np.arange(24, dtype=np.int32).reshape(2, 3, 4)[:, ::2],
    "float32 transposed (Fortran order)": lambda: _rng.standard_normal((4, 3)).astype(np.float32).T,
    "float64 Fortran order": lambda: np.asfortranarray(_rng.standard_normal((2, 5))),
    "big-endian float32": lambda: np.arange(10, dtype=">f4"),
    "complex128": lambda: np.array([1 + 2j, -3j]),
    "30 dimensions": lambda: np.ones((1,) * 30, np.float32),
    # made uninitialized and filled in place (fast_writer.fresh_bytes), the second on huge pages
    "float32 200 KiB": lambda: _rng.standard_normal((256, 200)).astype(np.float32),
    "float32 9 MiB": lambda: _rng.standard_normal((2048, 1152)).astype(np.float32),
    "float16 5 MiB odd length": lambda: _rng.standard_normal(2_621_441).astype(np.float16),
}


@pytest.mark.parametrize("kind", list(ARRAYS))
def test_npy_array_is_flowers_array_byte_for_byte(kind: str) -> None:
    a = ARRAYS[kind]()
    ours, flowers = npy_array(a), Array(a)
    assert (ours.dtype, ours.shape, ours.stype) == (flowers.dtype, flowers.shape, flowers.stype)
    assert isinstance(ours.data, bytes) and ours.data == flowers.data


@pytest.mark.parametrize("kind", list(ARRAYS))
def test_array_values_are_what_np_load_reads_and_own_their_memory(kind: str) -> None:
    array = Array(ARRAYS[kind]())
    got, want = array_values(array), array.numpy()
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want) and got.flags.f_contiguous == want.flags.f_contiguous
    assert got.flags.writeable
    if got.size:
        before = array.data
        got.reshape(-1)[0] = got.reshape(-1)[1 % got.size]  # (a copy: the Array's bytes stay)
        got.flat[0] = 0
        assert array.data == before and np.array_equal(array.numpy(), want)


def _outcome(fn: Callable[[], np.ndarray]) -> tuple[str, object]:
    try:
        a = fn()
    except Exception as e:  # (the test compares whatever np.load does)
        return "raises", type(e)
    return "reads", (a.dtype, a.shape, a.tobytes())


def _damaged(data: bytes) -> dict[str, bytes]:
    header_end = data.index(b"\n") + 1
    return {
        "truncated values": data[:-3],
        "one byte too many": data + b"\x00",
        "header only": data[:header_end],
        "bad magic": b"\x00" + data[1:],
        "format 3.0": data[:6] + b"\x03" + data[7:],
        "garbled header": data[:12] + b"{" + data[13:],
        "header longer than the data": data[:8] + b"\xff\xff" + data[10:],
        "format 2.0 header of 1.0's length": data[:6] + b"\x02\x00" + data[8:10] + b"\x00\x00" + data[10:],
        "magic and version only": data[:8],
        "empty": b"",
    }


@pytest.mark.parametrize("case", list(_damaged(Array(np.arange(4, dtype=np.float32)).data)))
def test_data_np_load_refuses_or_reads_otherwise_gets_its_outcome(case: str) -> None:
    data = _damaged(Array(np.arange(4, dtype=np.float32)).data)[case]
    array = Array(dtype="float32", shape=(4,), stype="numpy.ndarray", data=data)
    assert _outcome(lambda: array_values(array)) == _outcome(array.numpy)


def test_another_stype_goes_to_flower() -> None:
    array = Array(dtype="float32", shape=(1,), stype="torch.Tensor", data=b"\x00" * 4)
    assert _outcome(lambda: array_values(array)) == _outcome(array.numpy)


def test_record_from_tensors_is_flowers_record_of_the_state_dict() -> None:
    model = OrderedDict(
        [
            ("conv.weight", torch.randn(8, 3, 3, 3)),
            ("bn.num_batches_tracked", torch.tensor(5)),
            ("fc.weight", torch.randn(10, 8).t()),  # (not contiguous)
            ("fc.bias", torch.zeros(10)),
        ]
    )
    ours, flowers = record_from_tensors(model), ArrayRecord(model)
    assert list(ours) == list(flowers)
    for k in flowers:
        assert (ours[k].dtype, ours[k].shape, ours[k].data) == (flowers[k].dtype, flowers[k].shape, flowers[k].data)
    back = tensors_from_record(ours)
    assert all(torch.equal(back[k], model[k].float()) for k in model)


def _reference_squares(x: torch.Tensor, y: torch.Tensor | None = None) -> float:
    a = x.double().numpy().ravel() - (0.0 if y is None else y.double().numpy().ravel())
    return math.fsum(float(v) ** 2 for v in a)


def test_sum_of_squares_is_the_float64_sum_over_every_piece() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2 * SQUARES_PIECE + 99, generator=g) * 1e3
    y = x * (1 + 1e-7)  # (float32 differences would round; float64 ones do not)
    assert float(sum_of_squares(x)) == pytest.approx(_reference_squares(x), rel=1e-13)
    assert float(sum_of_squares(x, y)) == pytest.approx(_reference_squares(x, y), rel=1e-12)
    assert float(sum_of_squares(x, x)) == 0.0 and float(sum_of_squares(torch.zeros(0))) == 0.0
    t = torch.randn(30, 20, generator=g).t()  # (not contiguous)
    assert float(sum_of_squares(t)) == pytest.approx(_reference_squares(t), rel=1e-13)
    at = SQUARES_PIECE + 7  # one value in the second piece
    z = torch.zeros(2 * SQUARES_PIECE)
    z[at] = 3.0
    assert float(sum_of_squares(z)) == 9.0 and float(sum_of_squares(z, torch.zeros_like(z))) == 9.0


def test_not_finite_and_norm_names_the_first_three_and_measures_in_float64() -> None:
    g = torch.Generator().manual_seed(6)
    ts = {
        "a": torch.randn(SQUARES_PIECE + 10, generator=g),
        "half": torch.randn(100, generator=g).half(),
        "bf16": torch.randn(100, generator=g).bfloat16(),
        "empty": torch.zeros(0),
    }
    bad, norm = not_finite_and_norm(ts)
    assert bad == [] and norm == pytest.approx(math.sqrt(sum(_reference_squares(t) for t in ts.values())), rel=1e-12)
    for value in (math.nan, math.inf, -math.inf):
        for name in ("a", "half", "bf16"):
            broken = {k: v.clone() for k, v in ts.items()}
            broken[name].view(-1)[-1] = value  # (in the last piece)
            assert not_finite_and_norm(broken)[0] == [name]
    many = {f"t{i}": torch.full((3,), math.nan if i % 2 else 1.0) for i in range(10)}
    assert not_finite_and_norm(many)[0] == ["t1", "t3", "t5"]
    # float64 tensors (squares may overflow there) take the general path, with the same answer
    mixed = {"a": ts["a"], "d": torch.tensor([3.0, 4.0], dtype=torch.float64)}
    assert not_finite_and_norm(mixed) == ([], pytest.approx(math.sqrt(_reference_squares(ts["a"]) + 25.0), rel=1e-12))
    assert not_finite_and_norm({}) == ([], 0.0)
    huge = {"w": torch.full((4,), 3e38)}  # squares past float32's range: float64 holds them
    assert not_finite_and_norm(huge) == ([], pytest.approx(6e38, rel=1e-6))


def test_kept_values_are_measured_as_their_dense_tensors() -> None:
    """What a client sent with SBC, held as positions and one value: the same names in the same
    order and the same norm as the dense tensors, mixed with dense ones and alone."""
    g = torch.Generator().manual_seed(8)
    positions = torch.randperm(5000, generator=g)[:300].sort().values.numpy()
    kept = {
        "s": KeptValues((50, 100), positions, 0.123456789),
        "neg": KeptValues((5000,), positions, -2.5e-3),
        "none": KeptValues((7,), np.zeros(0, dtype=np.int64), 0.0),
        "each": KeptValues((5000,), positions, torch.randn(300, generator=g).numpy()),
    }
    dense = {k: to_dense(v) for k, v in kept.items()}
    for tensors in (kept, {**kept, "d": torch.randn(SQUARES_PIECE + 3, generator=g)}):
        want = {k: dense.get(k, v) for k, v in tensors.items()}
        bad, norm = not_finite_and_norm(tensors)
        assert bad == [] and norm == pytest.approx(not_finite_and_norm(want)[1], rel=1e-14)
    for value in (math.nan, math.inf):
        broken = {"d": torch.ones(3), "s": KeptValues((50, 100), positions, value), "t": torch.full((2,), math.nan)}
        assert not_finite_and_norm(broken)[0] == ["s", "t"]
        each = np.ones(300, dtype=np.float32)
        each[-1] = value
        assert not_finite_and_norm({"e": KeptValues((5000,), positions, each)})[0] == ["e"]
    # A non-finite value at no position is no value at all.
    assert not_finite_and_norm({"x": KeptValues((4,), np.zeros(0, dtype=np.int64), math.nan)}) == ([], 0.0)
