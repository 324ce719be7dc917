"""records.py's own Array bytes (``npy_array``) and reader (``array_values``): what Flower's
``Array(ndarray)`` and ``Array.numpy()`` give, byte for byte and value for value, for every kind
of array a model or a user's app may put in a record, and the same outcome for data ``np.load``
would refuse or read otherwise."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fedcomp.flower.records import array_values, npy_array, record_from_tensors, tensors_from_record

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
