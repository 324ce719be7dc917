"""One-copy wire output: protobuf framing written by hand, every payload byte written once.

Serializing an update through protobuf copies each large ``bytes`` field several times (into the
message, on ``CopyFrom``, on ``SerializeToString``, and once more to append the CRC): for a dense
ResNet-50 update that was most of the encode's time. This module writes the same bytes in one
pass instead:

* :class:`Layout` collects an output as a sequence of parts: small framing bytes (field keys,
  varint lengths, the scalar fields protobuf serialized), ``bytes``-like payload fields, and
  :class:`DeferredDensePayload` values, tensors not yet cast to their wire type.
* :meth:`Layout.to_bytes` allocates the output once (a ``bytes`` object of the final size, see
  :func:`_new_bytes`; a large one reuses the memory of the previous large output of the same size
  when nothing else holds it), copies each ``bytes`` part into its slot and casts each deferred
  tensor straight into its slot (``copy_`` into a view of the output: the cast *is* the copy), then
  optionally appends the update's CRC-32 trailer. For a large output written by single-threaded
  torch the CRC runs on a second thread while the parts are written, a few megabytes behind them
  (:class:`_TrailingCRC`), so a dense update costs about one cast, not a cast plus a CRC pass.

With the wire kernel built (``fedcomp/_native/wire.c``, :data:`_KERNEL`), :meth:`Layout.to_bytes`
hands every part to it instead: bytes copied and float32 tensors cast to float16 (F16C) or copied,
a few kilobytes at a time, each piece's CRC-32 taken while it is still in cache, the output's two
halves on two threads at once (:func:`run_split`). Where the kernel is missing the steps above run.

Protobuf remains the reference: ``fedcomp.wire.serde`` builds the framing from protobuf's own
serialization of the small fields, and the tests assert the bytes equal ``SerializeToString``'s
for every payload type and at every varint length boundary. This module imports no generated
code; it knows varints and CRCs, not the schema.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType

import numpy as np
import torch

from fedcomp import _native
from fedcomp.wire.payloads import DTYPE_SIZES, TORCH_DTYPES, DensePayload, filled

#: Outputs at least this large are made as uninitialized ``bytes`` objects (:func:`_new_bytes`).
_MID = 64 << 10
#: Outputs at least this large may reuse the last one's memory and, on Linux, get huge pages.
_LARGE = 4 << 20
_HUGE_PAGE = 2 << 20
#: Buffers at least this large have their CRC computed on two threads.
_CRC_SPLIT = 8 << 20


def varint(value: int) -> bytes:
    """The minimal base-128 varint of a non-negative integer (what protobuf writes)."""
    if value < 128:
        return _ONE_BYTE[value]
    if value < 1 << 14:  # (two bytes: most lengths of a tensor's fields)
        return bytes((value & 0x7F | 0x80, value >> 7))
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

    @classmethod
    def of_parts(cls, encoding: str, flat: torch.Tensor, numels: Sequence[int]) -> list[DeferredDensePayload]:
        """One payload per consecutive part of the 1-D ``flat`` (``numels`` values each, in order,
        all of it): what a whole-update engine makes of its one copy of many tensors, each part a
        view by one ``split`` and the encoding checked once (about 0.6 against 2.7 us a tensor)."""
        if encoding not in TORCH_DTYPES:
            raise ValueError(f"encoding: {encoding!r} is not one of {sorted(TORCH_DTYPES)}")
        return [
            filled(cls, {"encoding": encoding, "source": part, "_data": None})  # (what __init__ sets)
            for part in flat.detach().split(list(numels))
        ]

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

    def add_framed(self, frame: bytes, blob: Part, n: int) -> None:
        """:meth:`add` of ``frame`` (small bytes) then of ``blob`` (``n`` bytes, at least one):
        the writer's two parts of a tensor, without the general checks of each."""
        self._small += frame
        if n < 4096 and type(blob) is not DeferredDensePayload:
            self._small += blob  # type: ignore[arg-type]  # (bytes-like: not deferred)
        else:
            self._flush()
            self.parts.append(blob)
        self.size += len(frame) + n

    def _flush(self) -> None:
        if self._small:
            self.parts.append(bytes(self._small))
            self._small = bytearray()

    def to_bytes(self, crc_tag: int | None = None) -> bytes:
        """The parts written once into one new ``bytes`` object; with ``crc_tag``, followed by
        that byte and the CRC-32 of everything before it, little-endian (the update's trailer)."""
        self._flush()
        if crc_tag is not None and _KERNEL is not None:
            return write_fused(self.size, crc_tag, self._ops)
        trailer = 0 if crc_tag is None else 5
        out, view = _new_bytes(self.size + trailer)
        mem = view.data
        # The CRC trails on a second thread only where torch casts on one (the reference app's
        # torch-threads = 1): beside torch's own two threads it slows the casts more than it
        # saves (A/B on 2 cores: 14.4 ms against 13.1 ms sequential for a 51 MB update).
        pipelined = crc_tag is not None and self.size >= _CRC_PIPELINE and torch.get_num_threads() == 1
        trailing = _TrailingCRC(mem) if pipelined else None
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
            if trailing is not None:
                trailing.written(pos)
        if crc_tag is not None:
            _finish(view, pos, crc_tag, trailing.result(pos) if trailing is not None else crc32(mem[:pos]))
        del view, mem
        return out if isinstance(out, bytes) else bytes(out)

    def _ops(self, view: np.ndarray) -> list[Op]:
        """The kernel's ops writing every part into ``view`` (:func:`run_split`): a bytes part
        copied, a float32 CPU tensor cast (or copied) by the kernel; any other deferred tensor
        cast by torch first, the kernel then taking only its CRC."""
        base, pos = view.ctypes.data, 0
        ops: list[Op] = []
        op: Op | None
        for part in self.parts:
            if type(part) is bytes:  # (framing, most parts)
                n = len(part)
                op = (OP_COPY, base + pos, part, n)
            elif isinstance(part, DeferredDensePayload):
                n = part.nbytes
                op = cast_op(part.source, part.encoding, base + pos, n)
                if op is None:
                    part.write_into(view, pos)
                    op = (OP_CRC, 0, base + pos, n)
            else:
                n = _part_len(part)
                op = (OP_COPY, base + pos, part, n)
            if n:
                ops.append(op)
            pos += n
        return ops


def _finish(view: np.ndarray, pos: int, crc_tag: int, value: int) -> None:
    """The update's trailer at ``pos``: the tag byte, then the CRC-32 little-endian."""
    view[pos] = crc_tag
    view[pos + 1 : pos + 5] = np.frombuffer(value.to_bytes(4, "little"), dtype=np.uint8)


def write(parts: Sequence[Part], crc_tag: int | None = None) -> bytes:
    """:meth:`Layout.to_bytes` of ``parts``."""
    layout = Layout()
    for part in parts:
        layout.add(part)
    return layout.to_bytes(crc_tag)


# --- the fused kernel -------------------------------------------------------------------------


def _fused_kernel() -> ModuleType | None:
    """The wire kernel where it has a carry-less CRC (x86-64 with PCLMULQDQ: every x86-64 CPU
    since 2010); elsewhere its table CRC (about 1.5 GB/s) would be slower than isal's or zlib's,
    so the writer keeps torch's casts and those CRCs."""
    kernel = _native.load("wire")
    if kernel is None or kernel.features()["crc"] == "table":
        return None
    return kernel


#: ``fedcomp._native._wire`` (casts and copies with the CRC-32 taken in the same pass), or None:
#: then torch casts and the CRC is a second pass (:class:`_TrailingCRC`, :func:`crc32`).
_KERNEL = _fused_kernel()
_KERNEL_PID = os.getpid()
#: Whether the kernel casts float16 itself (F16C, the instructions torch's vectorized casts use).
_F16C = _KERNEL is not None and bool(_KERNEL.features()["f16c"])

#: The kernel's op kinds (``fedcomp/_native/wire.c``): an op is ``(kind, dst, src, nbytes)``
#: with addresses as integers (``src`` of a copy may be a bytes-like object) and ``nbytes`` the
#: wire side's length; the CRC runs over the wire side.
OP_COPY, OP_F32_F16, OP_F16_F32, OP_CRC = 0, 1, 2, 3
Op = tuple[int, int, "int | bytes | bytearray | memoryview", int]


def cast_op(src: torch.Tensor, encoding: str, dst: int, nbytes: int) -> Op | None:
    """The op writing the values of ``src`` as ``encoding`` into the ``nbytes`` at ``dst``, or
    None where the kernel cannot (not a contiguous CPU tensor of that many values, in the wire's
    own dtype or float32; float32 to float16 without F16C; float32 to bfloat16). A tensor already
    in the wire's dtype is copied (:mod:`fedcomp.methods.dense_device` casts on the device)."""
    if not src.is_cpu or not src.is_contiguous() or src.numel() * DTYPE_SIZES[encoding] != nbytes:
        return None
    if src.dtype == TORCH_DTYPES[encoding]:
        return (OP_COPY, dst, src.data_ptr(), nbytes)
    if src.dtype == torch.float32 and encoding == "float16" and _F16C:
        return (OP_F32_F16, dst, src.data_ptr(), nbytes)
    return None


def write_fused(size: int, crc_tag: int, ops_of: Callable[[np.ndarray], list[Op]]) -> bytes:
    """A new output of ``size`` bytes and the CRC trailer, written by the kernel: ``ops_of`` gets
    the output's writable view and returns the ops that fill it (:func:`run_split`)."""
    assert _KERNEL is not None
    out, view = _new_bytes(size + 5)
    _finish(view, size, crc_tag, run_split(_KERNEL, ops_of(view), size))
    del view
    return out if isinstance(out, bytes) else bytes(out)


def _split_op(op: Op, cut: int) -> tuple[Op, Op]:
    """``op`` as two ops, the first covering ``cut`` bytes of its wire side (even for a cast)."""
    kind, dst, src, n = op
    if kind == OP_CRC:
        assert isinstance(src, int)
        return (kind, dst, src, cut), (kind, dst, src + cut, n - cut)
    dst_step, src_step = (1, 2) if kind == OP_F32_F16 else (2, 1) if kind == OP_F16_F32 else (1, 1)
    rest = memoryview(src).cast("B")[cut:] if not isinstance(src, int) else src + src_step * cut
    return (kind, dst, src, cut), (kind, dst + dst_step * cut, rest, n - cut)


#: Ops covering at least this many bytes run on two threads (:func:`run_split`).
_SPLIT_MIN = 4 << 20


def run_split(kernel: object, ops: list[Op], total: int) -> int:
    """Run ``ops`` (``total`` wire bytes in all) through the kernel and return the CRC-32 of
    their wire side in order: at :data:`_SPLIT_MIN` bytes and more as two halves at once, their
    CRCs combined. The halves run on two threads of torch's OpenMP team (``run2``: its workers
    spin for milliseconds after each torch op, so a thread of our own would share a core with one)
    or, in a process without OpenMP, here and on the CRC worker (the kernel releases the GIL).
    The ops write disjoint bytes, so the halves' order does not matter."""
    run = kernel.run  # type: ignore[attr-defined]
    if total < _SPLIT_MIN or not ops:
        return int(run(ops, 0))
    half, acc, i = total // 2, 0, 0
    while i < len(ops) - 1 and acc + ops[i][3] <= half:  # ops[i] holds the middle byte
        acc += ops[i][3]
        i += 1
    cut = (half - acc) & ~1
    first, second = list(ops[:i]), list(ops[i + 1 :])
    if cut:
        head, tail = _split_op(ops[i], cut)
        first.append(head)
        second.insert(0, tail)
    else:
        second.insert(0, ops[i])
    # A forked child may have inherited the parent's OpenMP team without its threads: only the
    # process that loaded the kernel hands work to OpenMP.
    pair = kernel.run2(first, second) if os.getpid() == _KERNEL_PID else None  # type: ignore[attr-defined]
    if pair is not None:
        value, rest = pair
    else:  # no OpenMP runtime in the process: the second half on the CRC worker
        later = _crc_pool().submit(run, second, 0)
        value = run(first, 0)
        rest = later.result()
    return int(kernel.crc32_combine(value, rest, total - acc - cut))  # type: ignore[attr-defined]


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
    """A new, not yet filled output of ``n`` bytes and a writable uint8 view of it
    (:func:`fresh_bytes`), a large one reusing memory.

    A large output reuses memory (:func:`_reuse_spare`): a client or server writes an update
    of the same size every round, and each fresh output of tens of megabytes is first-touch page
    faults that cost more than the cast itself (2 to 5x a warm cast measured on a 2-core VM, huge
    pages or not); the small buffers of per-tensor ``half()`` and ``clone()`` come back warm from
    malloc's free lists, outputs past malloc's mmap threshold (32 MB at most) never do."""
    if _BYTES_API is None or n < _LARGE:
        return fresh_bytes(n)
    out = _reuse_spare(n)
    if out is None:
        return _keep(fresh_bytes(n))
    return _keep((out, _view_at(_BYTES_API[1](out), n)))  # type: ignore[operator]


def _keep(made: tuple[bytes | bytearray, np.ndarray]) -> tuple[bytes | bytearray, np.ndarray]:
    if _REUSE_OUTPUT and isinstance(made[0], bytes):
        global _SPARE
        _SPARE = made[0]
    return made


def fresh_bytes(n: int) -> tuple[bytes | bytearray, np.ndarray]:
    """A new, not yet filled buffer of ``n`` bytes and a writable uint8 view of it, for the caller
    to fill before anyone else sees it.

    On CPython a buffer of :data:`_MID` bytes or more is a ``bytes`` object created
    uninitialized (``PyBytes_FromStringAndSize(NULL, n)``, how C code builds bytes), so the
    result needs no final copy (an SBC update of a ResNet-50, 0.36 MB: about 13 us less, warm);
    elsewhere, and for small buffers, a ``bytearray`` (the caller copies it into ``bytes``). On
    Linux a buffer of :data:`_LARGE` bytes or more has its interior advised to use huge pages, as
    NumPy does for its own large arrays: first-touch page faults on 4 kB pages cost about as much
    as the copy that fills them (a ResNet-50's record, 102 MB in 161 arrays: 44 -> 29 ms on the
    2-core build machine)."""
    if _BYTES_API is None or n < _MID:
        buf = bytearray(n)
        return buf, np.frombuffer(buf, dtype=np.uint8)
    new, ptr = _BYTES_API
    made = new(None, n)  # type: ignore[operator]
    addr: int = ptr(made)  # type: ignore[operator]
    if n >= _LARGE and _MADVISE is not None:
        lo = -(-addr // _HUGE_PAGE) * _HUGE_PAGE
        hi = (addr + n) // _HUGE_PAGE * _HUGE_PAGE
        if hi > lo:
            _MADVISE(lo, hi - lo, _MADV_HUGEPAGE)  # type: ignore[operator]  # advice only: failure is fine
    return made, _view_at(addr, n)


class _At:
    """``n`` bytes at ``addr`` as NumPy's array interface describes them (writable): what
    :func:`_view_at` views, with no ctypes array type made for each length (ctypes keeps every
    one it makes; an SBC update has a new length every round)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, addr: int, n: int) -> None:
        self.__array_interface__ = {"data": (addr, False), "shape": (n,), "typestr": "|u1", "version": 3}


def _view_at(addr: int, n: int) -> np.ndarray:
    """A writable uint8 view of the ``n`` bytes at ``addr`` (memory the caller keeps alive)."""
    return np.asarray(_At(addr, n))


#: Offset of a bytes object's cached hash (``ob_shash``) before its data (``ob_sval``): CPython
#: 3.11 to 3.13 lay a ``PyBytesObject`` out as the variable-size header, the hash, then the data.
_HASH_OFFSET = ctypes.sizeof(ctypes.c_ssize_t)


def _hash_slot_found() -> bool:
    """Whether the word before a bytes object's data holds its cached hash on this interpreter
    (checked on a sample, so a layout that moved the hash turns output reuse off, never corrupts)."""
    if _BYTES_API is None:
        return False
    sample = bytes(range(256)) * 64
    h = hash(sample)
    data: int = _BYTES_API[1](sample)  # type: ignore[operator]
    return ctypes.c_ssize_t.from_address(data - _HASH_OFFSET).value == h


#: Whether :func:`_new_bytes` keeps its last large output for reuse (:func:`set_output_reuse`).
#: Only where reference counts are exact, CPython with its GIL (a free-threaded build defers
#: counts, so "nobody else holds it" cannot be read off them), and where the cached hash is where
#: this module resets it.
_REUSE_OUTPUT = bool(getattr(sys, "_is_gil_enabled", lambda: True)()) and _hash_slot_found()
#: The last large output :func:`_new_bytes` made, kept for reuse once every other holder is gone.
_SPARE: bytes | None = None
_SPARE_LOCK = threading.Lock()


def set_output_reuse(enabled: bool) -> None:
    """Turn the reuse of large outputs (:func:`_new_bytes`) on or off; off also frees the kept
    output. On by default on CPython: it keeps at most one output (the last large one) alive
    between calls, e.g. one dense update of the model's size per process."""
    global _REUSE_OUTPUT, _SPARE
    with _SPARE_LOCK:
        _REUSE_OUTPUT = bool(enabled) and _hash_slot_found()
        _SPARE = None


def _reuse_spare(n: int) -> bytes | None:
    """The kept output, to be overwritten, if it is ``n`` bytes long and nothing but this module
    holds it; else None (and the kept output is let go when its size differs).

    Overwriting a ``bytes`` object is safe only while no other code can see it: its reference
    count proves that (the kept object is taken out of the module under a lock first, so two
    threads never claim it; a ``memoryview`` or NumPy array over it holds a reference too). Its
    cached hash is reset, so a hash taken before reuse is never served for the new contents.
    """
    global _SPARE
    if not _REUSE_OUTPUT:
        return None
    with _SPARE_LOCK:
        spare, _SPARE = _SPARE, None
    if spare is None or len(spare) != n or sys.getrefcount(spare) != 2:  # this frame and the argument
        return None
    assert _BYTES_API is not None  # _REUSE_OUTPUT implies it
    data: int = _BYTES_API[1](spare)  # type: ignore[operator]
    ctypes.c_ssize_t.from_address(data - _HASH_OFFSET).value = -1  # "not computed yet"
    return spare


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


def _accelerated_crc32() -> Callable[..., int] | None:
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


#: Outputs at least this large have their CRC computed on a second thread while being written.
_CRC_PIPELINE = 4 << 20
#: The trailing CRC thread takes the written bytes in pieces of at least this size.
_CRC_STEP = 2 << 20

_CRC_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _crc_pool() -> ThreadPoolExecutor:
    """One worker thread, process-wide, rebuilt after a fork (a forked child has no threads)."""
    global _CRC_POOL
    if _CRC_POOL is None or _CRC_POOL[0] != os.getpid():
        _CRC_POOL = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="fedcomp-crc"))
    return _CRC_POOL[1]


class _TrailingCRC:
    """The CRC-32 of a buffer being written front to back, computed on a second thread a piece
    behind the writer: :meth:`written` says how far the buffer is final, :meth:`result` waits for
    the rest. The pieces run in order on one worker (each continues the last one's CRC), and both
    CRC functions release the GIL, so the CRC overlaps the casts and copies of the parts."""

    def __init__(self, mem: memoryview) -> None:
        self._mem = mem
        self._pool = _crc_pool()
        self._value = 0
        self._done = 0  # bytes handed to the worker so far
        self._pending: list[Future[None]] = []

    def _piece(self, begin: int, end: int) -> None:
        self._value = _crc_continue(self._mem[begin:end], self._value)

    def written(self, end: int) -> None:
        """Bytes ``[0, end)`` are final: hand the worker what is new once it is a piece."""
        if end - self._done >= _CRC_STEP:
            self._pending.append(self._pool.submit(self._piece, self._done, end))
            self._done = end

    def result(self, end: int) -> int:
        """The CRC-32 of bytes ``[0, end)`` (all final)."""
        if end > self._done:
            self._pending.append(self._pool.submit(self._piece, self._done, end))
            self._done = end
        for f in self._pending:
            f.result()
        return self._value


def crc32_async(data: memoryview) -> Future[int]:
    """:func:`crc32` of ``data`` computed on the CRC worker thread (the GIL released while it
    runs), for a caller with other work to overlap it with; ``data`` must not change meanwhile."""
    return _crc_pool().submit(_crc_continue, data, 0)  # not crc32: it may itself use this worker


def _crc_continue(data: memoryview, value: int) -> int:
    """``zlib.crc32(data, value)``, by the kernel or :data:`FAST_CRC32` when there is one."""
    if _KERNEL is not None:
        return int(_KERNEL.crc32(data, value))
    return FAST_CRC32(data, value) if FAST_CRC32 is not None else zlib.crc32(data, value)


def crc32(data: bytes | bytearray | memoryview) -> int:
    """``zlib.crc32(data)``, computed by :data:`FAST_CRC32` when available; otherwise a large
    buffer is split in two halves whose CRCs zlib computes on two threads (the calling one and
    the CRC worker; zlib releases the GIL), combined by :func:`crc32_combine`. (Splitting
    :data:`FAST_CRC32`'s work too measured no faster inside a whole encode or decode.)"""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    n = len(view)
    if _KERNEL is not None or FAST_CRC32 is not None or n < _CRC_SPLIT:
        return _crc_continue(view, 0)
    half = n // 2
    second = _crc_pool().submit(_crc_continue, view[half:], 0)
    first = _crc_continue(view[:half], 0)
    return crc32_combine(first, second.result(), n - half)
