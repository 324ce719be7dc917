"""Model tensors <-> Flower ArrayRecords, and the replica digest both sides compare."""

from __future__ import annotations

import hashlib
import io
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fedcomp.codecs.flat import tensors_on_host, tensors_to_device
from fedcomp.codecs.sbc import serial_torch_thread
from fedcomp.errors import ConfigError
from fedcomp.methods.sent import KeptValues, Sent
from fedcomp.wire.fast_writer import fresh_bytes

#: Integers of at most this magnitude are exact in float32.
F32_EXACT_INT = 1 << 24


def tensors_from_record(record: ArrayRecord, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Float32 tensors of an ArrayRecord, in its order. Floating-point arrays are cast; integer and
    bool arrays (BatchNorm's ``num_batches_tracked``, masks) travel as float32 too, which holds
    each of their values exactly up to 2**24 in magnitude (beyond: a :class:`ConfigError` naming
    the array; complex arrays likewise). On a device other than the CPU the tensors are views of
    one buffer, copied there at once."""
    host: dict[str, torch.Tensor] = {}
    for name, array in record.items():
        t = torch.from_numpy(array_values(array))
        if t.is_complex():
            raise ConfigError(f"array {name!r} has dtype {t.dtype}: fedcomp carries real arrays only")
        if not t.is_floating_point() and t.dtype != torch.bool and t.numel():
            low, high = int(t.min()), int(t.max())
            if low < -F32_EXACT_INT or high > F32_EXACT_INT:
                raise ConfigError(
                    f"array {name!r} ({t.dtype}) holds {high if high > F32_EXACT_INT else low}: fedcomp carries "
                    f"integer arrays as float32, exact up to 2**24 = {F32_EXACT_INT} in magnitude"
                )
        host[name] = t.to(dtype=torch.float32)
    return tensors_to_device(host, device)


def check_integer_arrays(record: ArrayRecord, min_compress_numel: int) -> None:
    """Raise a :class:`ConfigError` naming an integer or bool array of ``min_compress_numel``
    values or more: it would be compressed like a float tensor, hence no longer exact (smaller
    ones, such as BatchNorm's ``num_batches_tracked``, go dense and arrive exactly)."""
    for name, array in record.items():
        numel = math.prod(array.shape)
        if array.dtype.startswith(("int", "uint", "bool")) and numel >= min_compress_numel:
            raise ConfigError(
                f"array {name!r} ({array.dtype}, {numel} values) would be compressed lossily: integer and bool "
                f"arrays must be smaller than min-compress-numel = {min_compress_numel} (raise it, or leave the "
                "array out of the model's arrays)"
            )


def record_from_tensors(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """The tensors (any device) as an ArrayRecord, in order: the Arrays Flower's own
    ``ArrayRecord(state_dict)`` makes, byte for byte (:func:`npy_array`)."""
    return ArrayRecord(OrderedDict((k, npy_array(t.numpy())) for k, t in tensors_on_host(tensors).items()))


#: Flower's ``SType.NUMPY``: the Array's data is what ``np.save`` writes.
_NUMPY_STYPE = "numpy.ndarray"


def npy_array(a: np.ndarray) -> Array:
    """``Array(a)``: the same dtype, shape and bytes (``np.save``'s: a format 1.0 header, then the
    values), made in one copy of the values. Flower's own goes through ``np.save`` into a
    ``BytesIO`` and copies the values two or three times (a ResNet-50's 102 MB took 45 ms on the
    build machine against 22 ms here, a warm copy of them 11 ms). The bytes are made uninitialized
    and filled in place, large ones on huge pages (:func:`fedcomp.wire.fast_writer.fresh_bytes`).
    Arrays whose bytes ``np.save`` lays out otherwise (not C-contiguous, objects, a header past
    format 1.0) go through Flower's."""
    shape = tuple(int(d) for d in a.shape)
    header = _npy_header(a.dtype, shape) if a.flags.c_contiguous and not a.dtype.hasobject else None
    if header is None:
        return Array(a)
    out, view = fresh_bytes(len(header) + a.nbytes)
    view[: len(header)] = np.frombuffer(header, dtype=np.uint8)
    # The values' one copy, by NumPy, which lets go of the GIL for it (a digest of the model on
    # another thread runs meanwhile: fedcomp.flower.mod's downlink).
    np.copyto(view[len(header) :], a.reshape(-1).view(np.uint8))
    data = out if isinstance(out, bytes) else bytes(out)
    return Array(dtype=str(a.dtype), shape=shape, stype=_NUMPY_STYPE, data=data)


@lru_cache(maxsize=4096)
def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes | None:
    """``np.save``'s header of a C-ordered array (a model's every round: kept), or None where it
    does not fit format 1.0 (``np.save`` writes 2.0 there)."""
    header = io.BytesIO()
    fields = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    try:
        np.lib.format.write_array_header_1_0(header, fields)
    except ValueError:
        return None
    return header.getvalue()


def array_values(array: Array) -> np.ndarray:
    """``array.numpy()`` (what ``np.load`` reads from its data) in one copy of the values, where
    ``np.load`` makes two (it reads in pieces of 256 KiB into a new array); a writable array of
    the Array's own dtype and shape. Data ``np.load`` would read otherwise (another format, a
    length that does not match the header, objects) goes to it: the same array, or its error."""
    view = _npy_view(array)
    return array.numpy() if view is None else view.copy(order="K")


def _npy_view(array: Array) -> np.ndarray | None:
    """A read-only view of an Array's values in its data, or None where :func:`array_values`
    leaves it to ``np.load``."""
    if array.stype != _NUMPY_STYPE:
        return None
    data = array.data
    # The header's length: two bytes after the magic and version 1.0, four after 2.0.
    if data[:6] != b"\x93NUMPY" or data[7:8] != b"\x00" or data[6:7] not in (b"\x01", b"\x02"):
        return None
    width = 2 if data[6] == 1 else 4
    start = 8 + width + int.from_bytes(data[8 : 8 + width], "little")
    parsed = _npy_parse(data[:start])
    if parsed is None:
        return None
    shape, fortran, dtype = parsed
    count = math.prod(shape)
    if dtype.hasobject or len(data) - start != count * dtype.itemsize:
        return None
    if count == 0:
        return np.empty(shape, dtype=dtype, order="F" if fortran else "C")
    values = np.frombuffer(data, dtype=dtype, count=count, offset=start)
    return values.reshape(shape, order="F" if fortran else "C")


@lru_cache(maxsize=4096)
def _npy_parse(header: bytes) -> tuple[tuple[int, ...], bool, np.dtype] | None:
    """What ``np.load`` reads from an ``.npy`` header (format 1.0 or 2.0; a model's every round:
    kept, since numpy parses each with ``ast.literal_eval``, about 50 us), or None where it
    refuses it."""
    head = io.BytesIO(header)
    try:
        version = np.lib.format.read_magic(head)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(head)
    except ValueError:
        return None
    return (tuple(shape), bool(fortran), dtype) if head.tell() == len(header) else None


def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over names, shapes and float32 bytes, in order: equal iff bit-identical."""
    h = hashlib.sha256()
    for name, t in tensors_on_host({k: v.detach().to(torch.float32) for k, v in tensors.items()}).items():
        h.update(name.encode())
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().data)  # in place, no copy
    return h.hexdigest()[:32]


def digest_soon(tensors: Mapping[str, torch.Tensor]) -> Future[str]:
    """:func:`digest` of ``tensors``, taken on a thread of its own: the caller does other work
    meanwhile and must not change the tensors before the result is in. SHA-256 lets go of the GIL
    while it hashes, so a model's digest (about 50 ms for a ResNet-50 on the 2-core build machine)
    and the caller's copying run on two cores at once."""
    global _HASHER
    if _HASHER is None or _HASHER[0] != os.getpid():  # (a forked child has no pool threads)
        _HASHER = (os.getpid(), ThreadPoolExecutor(1, "fedcomp-digest", initializer=serial_torch_thread))
    return _HASHER[1].submit(digest, tensors)


_HASHER: tuple[int, ThreadPoolExecutor] | None = None


def fp32_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """What the tensors would cost dense in float32: the baseline for compression factors."""
    return 4 * sum(t.numel() for t in tensors.values())


def not_finite_and_norm(tensors: Mapping[str, Sent]) -> tuple[list[str], float]:
    """The first few tensors holding NaN or inf (empty: all finite), and the L2 norm of all of
    them together, in float64: the uplink report's, the client's DP clipping, the server's norm
    checks (one computation, so the client's and the server's agree). From each tensor's L2 norm
    in float64: no float32 value squared overflows it, so it is finite exactly when every value
    is; one fused operator and one wait for the device for all of them (a check and a wait per
    tensor cost a GPU client hundreds per round). A :class:`KeptValues` (what a client sent with
    SBC, STC or top-k) from its values alone, without a dense tensor."""
    norms: dict[str, float] = {}
    bad: dict[str, bool] = {}
    ts = {k: t.detach() for k, t in tensors.items() if not isinstance(t, KeptValues)}
    if ts and all(t.device.type == "cpu" and t.dtype in _NORM_DTYPES for t in ts.values()):
        # (``_foreach_norm`` makes a float64 copy of each tensor on a CPU: twice the time)
        norms = {k: math.sqrt(float(sum_of_squares(t))) for k, t in ts.items()}
    elif ts and len({t.device for t in ts.values()}) == 1 and all(t.dtype in _NORM_DTYPES for t in ts.values()):
        found = torch.stack(torch._foreach_norm(list(ts.values()), 2, dtype=torch.float64)).tolist()
        norms = dict(zip(ts, found, strict=True))
    elif ts:  # (float64 values may square past float64's range: finiteness asked of the values)
        bad = {k: not bool(torch.isfinite(t).all()) for k, t in ts.items()}
        norms = {k: float(t.double().norm()) for k, t in ts.items()}
    for k, t in tensors.items():
        if isinstance(t, KeptValues):
            norms[k] = math.sqrt(t.sum_of_squares())
    names = [k for k in tensors if bad.get(k, not math.isfinite(norms[k]))]
    return names[:3], math.sqrt(math.fsum(norms[k] * norms[k] for k in tensors))


#: Dtypes whose squares cannot overflow a float64 sum (:func:`not_finite_and_norm`).
_NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


#: :func:`sum_of_squares` works through a tensor in pieces of this many values.
SQUARES_PIECE = 1 << 16

_SCRATCH = threading.local()


def sum_of_squares(x: torch.Tensor, minus: torch.Tensor | None = None) -> torch.Tensor:
    """``sum((x - minus) ** 2)`` over every value (``minus`` of ``x``'s shape, or none), each
    difference and square in float64, as a 0-d float64 tensor on ``x``'s device (no wait for
    it). In pieces of :data:`SQUARES_PIECE` values converted into two float64 buffers that this
    thread reuses: whole-tensor float64 copies took a ResNet-50's 25.6M values twice to four
    times as long on the 2-core build machine (92 against 26 ms for a difference's), the copies
    of a piece staying in the CPU's cache and no memory new. On another device, whole tensors (a
    piece there would be four kernel launches: a ResNet-50 is about 400 pieces)."""
    x = x.detach().reshape(-1)
    y = None if minus is None else minus.detach().reshape(-1)
    if x.device.type != "cpu":
        d = x.double() if y is None else x.double() - y.double()
        return torch.dot(d, d)
    bufs: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = _SCRATCH.__dict__.setdefault("bufs", {})
    if x.device not in bufs:
        bufs[x.device] = (
            torch.empty(SQUARES_PIECE, dtype=torch.float64, device=x.device),
            torch.empty(SQUARES_PIECE, dtype=torch.float64, device=x.device),
        )
    d_buf, e_buf = bufs[x.device]
    parts = []
    for at in range(0, x.shape[0], SQUARES_PIECE):
        n = min(SQUARES_PIECE, x.shape[0] - at)
        d = d_buf[:n].copy_(x[at : at + n])
        if y is not None:
            d.sub_(e_buf[:n].copy_(y[at : at + n]))
        parts.append(torch.dot(d, d))
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()
