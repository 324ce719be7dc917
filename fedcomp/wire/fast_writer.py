"""One-copy wire output: protobuf framing written by hand, every payload byte written once.

Serializing an update through protobuf copies each large ``bytes`` field several times (into the
message, on ``CopyFrom``, on ``SerializeToString``, and once more to append the CRC): for a dense
ResNet-50 update that was most of the encode's time. This module writes the same bytes in one
pass instead:

* :class:`Layout` collects an output as a sequence of parts: small framing bytes (field keys,
  varint lengths, the scalar fields protobuf serialized), ``bytes``-like payload fields, and
  :class:`DeferredDensePayload` values, tensors not yet cast to their wire type.
* :meth:`Layout.to_bytes` allocates the output once (a ``bytes`` object of the final size, see
  :func:`_new_bytes`), copies each ``bytes`` part into its slot and casts each deferred tensor
  straight into its slot (``copy_`` into a view of the output: the cast *is* the copy), then
  optionally appends the update's CRC-32 trailer, computed on two threads (:func:`crc32`).

Protobuf remains the reference: ``fedcomp.wire.serde`` builds the framing from protobuf's own
serialization of the small fields, and the tests assert the bytes equal ``SerializeToString``'s
for every payload type and at every varint length boundary. This module imports no generated
code; it knows varints and CRCs, not the schema.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import torch

from fedcomp.wire.payloads import DTYPE_SIZES, TORCH_DTYPES, DensePayload

#: Outputs at least this large get the bytes-object fast path and, on Linux, huge pages.
_LARGE = 4 << 20
_HUGE_PAGE = 2 << 20
#: Buffers at least this large have their CRC computed on two threads.
_CRC_SPLIT = 8 << 20


def varint(value: int) -> bytes:
    """The minimal base-128 varint of a non-negative integer (what protobuf writes)."""
    if value < 128:
        return _ONE_BYTE[value]
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


_ONE_BYTE = [bytes((i,)) for i in range(128)]


def key(field: int, wire: int) -> bytes:
    """The key of a field: its number and wire type as one varint."""
    return varint((field << 3) | wire)


# --- deferred dense payloads ------------------------------------------------------------------


class DeferredDensePayload(DensePayload):
    """A :class:`DensePayload` whose values are still a tensor: ``source`` is cast to
    ``encoding`` when the payload is written (:meth:`write_into`, straight into the output
    buffer: one pass) or when :attr:`data` is first read (then cached).

    What the dense codecs' ``encode`` returns, so that encoding an update costs one cast into the
    wire bytes rather than a cast, a ``tobytes`` and protobuf's copies. ``source`` is read when
    the update is written: the tensor must not be modified between ``encode`` and serialization
    (the library serializes right after encoding). Values in ``float32`` go straight to the wire
    type; other dtypes go through float32 first when the wire type differs from theirs, as the
    eager path always did (so the bytes never depend on the path). Equal to a
    :class:`DensePayload` with the same encoding and bytes.
    """

    source: torch.Tensor

    def __init__(self, encoding: str, source: torch.Tensor) -> None:  # not the dataclass __init__
        if encoding not in TORCH_DTYPES:
            raise ValueError(f"encoding: {encoding!r} is not one of {sorted(TORCH_DTYPES)}")
        object.__setattr__(self, "encoding", encoding)
        object.__setattr__(self, "source", source.detach().reshape(-1))
        object.__setattr__(self, "_data", None)

    @property
    def nbytes(self) -> int:
        """Length of the wire bytes."""
        return self.source.numel() * DTYPE_SIZES[self.encoding]

    def _wire_source(self) -> torch.Tensor:
        """``source`` ready for one ``copy_`` into the wire type (float32 first where the eager
        path went through float32; non-CPU values cast on their device, then copied over)."""
        src, wire = self.source, TORCH_DTYPES[self.encoding]
        if src.dtype != wire and src.dtype != torch.float32:
            src = src.to(torch.float32)
        if src.device.type != "cpu":
            src = src.to(wire)
        return src

    def write_into(self, buffer: np.ndarray, offset: int) -> None:
        """Cast the values into ``buffer[offset : offset + nbytes]`` (``buffer``: a writable 1-d
        uint8 array; any offset, aligned or not)."""
        if not 0 <= offset <= len(buffer) - self.nbytes:
            raise ValueError(f"write_into: no room for {self.nbytes} bytes at {offset} of {len(buffer)}")
        if self.nbytes:
            # frombuffer rather than from_numpy of a slice: about 1 us, not 10-80 us, a tensor.
            out = torch.frombuffer(buffer, dtype=TORCH_DTYPES[self.encoding], count=self.source.numel(), offset=offset)
            out.copy_(self._wire_source())

    @property  # type: ignore[override]  # a read-only view of the dataclass field
    def data(self) -> bytes:
        """The wire bytes (cast on first use, then kept)."""
        cached: bytes | None = self.__dict__["_data"]
        if cached is None and not self.nbytes:
            cached = b""  # (an empty tensor may have stride 0, which view() refuses)
        elif cached is None:
            wire = self._wire_source().to(TORCH_DTYPES[self.encoding]).cpu()
            cached = wire.contiguous().view(torch.uint8).numpy().tobytes()
            object.__setattr__(self, "_data", cached)
        return cached

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DensePayload):
            return NotImplemented
        return self.encoding == other.encoding and self.data == other.data

    def __hash__(self) -> int:
        return hash((self.encoding, self.data))

    def __repr__(self) -> str:
        return f"DeferredDensePayload(encoding={self.encoding!r}, numel={self.source.numel()})"


# --- the output ---------------------------------------------------------------------------------

Part = bytes | bytearray | memoryview | DeferredDensePayload


def _part_len(part: Part) -> int:
    return part.nbytes if isinstance(part, DeferredDensePayload | memoryview) else len(part)


class Layout:
    """The parts of one output, in order. Consecutive small parts are merged as they come."""

    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.size = 0
        self._small = bytearray()

    def add(self, part: Part) -> None:
        """Append a part (bytes are referenced, not copied, unless small)."""
        n = _part_len(part)
        if n == 0:
            return
        if not isinstance(part, DeferredDensePayload) and n < 4096:
            self._small += part
        else:
            self._flush()
            self.parts.append(part)
        self.size += n

    def _flush(self) -> None:
        if self._small:
            self.parts.append(bytes(self._small))
            self._small = bytearray()

    def to_bytes(self, crc_tag: int | None = None) -> bytes:
        """The parts written once into one new ``bytes`` object; with ``crc_tag``, followed by
        that byte and the CRC-32 of everything before it, little-endian (the update's trailer)."""
        self._flush()
        trailer = 0 if crc_tag is None else 5
        out, view = _new_bytes(self.size + trailer)
        mem = view.data
        pos = 0
        for part in self.parts:
            if isinstance(part, DeferredDensePayload):
                n = part.nbytes
                part.write_into(view, pos)
            else:
                part = memoryview(part).cast("B")
                n = part.nbytes
                mem[pos : pos + n] = part
            pos += n
        if crc_tag is not None:
            view[pos] = crc_tag
            view[pos + 1 : pos + 5] = np.frombuffer(crc32(view[:pos].data).to_bytes(4, "little"), dtype=np.uint8)
        del view, mem
        return out if isinstance(out, bytes) else bytes(out)


def write(parts: Sequence[Part], crc_tag: int | None = None) -> bytes:
    """:meth:`Layout.to_bytes` of ``parts``."""
    layout = Layout()
    for part in parts:
        layout.add(part)
    return layout.to_bytes(crc_tag)


# --- allocation -------------------------------------------------------------------------------


def _bytes_api() -> tuple[object, object] | None:
    """CPython's ``PyBytes_FromStringAndSize`` and ``PyBytes_AsString``, or None elsewhere."""
    if sys.implementation.name != "cpython":
        return None
    try:
        new = ctypes.pythonapi.PyBytes_FromStringAndSize
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t]
        ptr = ctypes.pythonapi.PyBytes_AsString
        ptr.restype, ptr.argtypes = ctypes.c_void_p, [ctypes.py_object]
    except (AttributeError, OSError):  # pragma: no cover - a CPython without its C API exported
        return None
    return new, ptr


def _madvise_api() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).madvise
    except (AttributeError, OSError):  # pragma: no cover
        return None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_BYTES_API = _bytes_api()
_MADVISE = _madvise_api()
_MADV_HUGEPAGE = 14


def _new_bytes(n: int) -> tuple[bytes | bytearray, np.ndarray]:
    """A new, not yet filled output of ``n`` bytes and a writable uint8 view of it.

    On CPython a large output is a ``bytes`` object created uninitialized
    (``PyBytes_FromStringAndSize(NULL, n)``, how C code builds bytes) and filled through the view
    before anyone else sees it, so the result needs no final copy; elsewhere, and for small
    outputs, a ``bytearray`` (copied into ``bytes`` at the end). On Linux the large buffer's
    interior is advised to use huge pages, as NumPy does for its own large arrays: first-touch
    page faults on 4 kB pages cost about as much as the cast itself."""
    if _BYTES_API is None or n < _LARGE:
        buf = bytearray(n)
        return buf, np.frombuffer(buf, dtype=np.uint8)
    new, ptr = _BYTES_API
    out = new(None, n)  # type: ignore[operator]
    addr: int = ptr(out)  # type: ignore[operator]
    if _MADVISE is not None:
        lo = -(-addr // _HUGE_PAGE) * _HUGE_PAGE
        hi = (addr + n) // _HUGE_PAGE * _HUGE_PAGE
        if hi > lo:
            _MADVISE(lo, hi - lo, _MADV_HUGEPAGE)  # type: ignore[operator]  # advice only: failure is fine
    view: np.ndarray = np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(addr))
    return out, view


# --- CRC-32 -------------------------------------------------------------------------------------

_CRC_POLY = 0xEDB88320  # reflected IEEE 802.3 polynomial (zlib's)


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order), as zlib's ``multmodp``."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


def _x2nmodp(n: int, k: int) -> int:
    """x^(n * 2^k) modulo the CRC polynomial, as zlib's ``x2nmodp``."""
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's
    ``crc32_combine``, which Python's zlib module does not expose)."""
    return _multmodp(_x2nmodp(len2, 3), crc1) ^ crc2


def _accelerated_crc32() -> Callable[[memoryview], int] | None:
    """The CRC-32 of ISA-L (``isal``) or zlib-ng (``zlib-ng``) when installed: the same function
    as ``zlib.crc32``, with carry-less multiplication (about 10x zlib 1.2's speed on x86-64)."""
    try:
        from isal import isal_zlib  # type: ignore[import-not-found, unused-ignore]

        return isal_zlib.crc32  # type: ignore[no-any-return, unused-ignore]
    except ImportError:
        pass
    try:
        from zlib_ng import zlib_ng  # type: ignore[import-not-found, unused-ignore]

        return zlib_ng.crc32  # type: ignore[no-any-return, unused-ignore]
    except ImportError:
        return None


#: ``isal``'s or ``zlib-ng``'s crc32 when one is installed, else None (zlib's, on two threads).
FAST_CRC32 = _accelerated_crc32()


def crc32(data: bytes | bytearray | memoryview) -> int:
    """``zlib.crc32(data)``, computed by :data:`FAST_CRC32` when available; otherwise a large
    buffer is split in two halves whose CRCs zlib computes on two threads (it releases the GIL),
    combined by :func:`crc32_combine`."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if FAST_CRC32 is not None:
        return FAST_CRC32(view)
    n = len(view)
    if n < _CRC_SPLIT:
        return zlib.crc32(view)
    half = n // 2
    second: list[int] = []
    worker = threading.Thread(target=lambda: second.append(zlib.crc32(view[half:])), daemon=True)
    worker.start()
    first = zlib.crc32(view[:half])
    worker.join()
    return crc32_combine(first, second[0], n - half)
