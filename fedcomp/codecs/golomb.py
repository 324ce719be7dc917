"""Golomb-Rice coding of sorted positions (SBC, Sattler et al. 2018, Algorithm 3).

Positions on CPU are coded by the C kernel ``fedcomp._native._sbc`` where it is built (one pass
over the positions or the bitstream, GIL released); without it (or with ``FEDCOMP_NATIVE=0``) in
NumPy, every step a whole-array operation (``packbits``/``unpackbits`` and ``flatnonzero``:
several times faster there than the torch ops). Positions on any other device are coded in
torch. All paths give the same bytes, positions and errors (tested on CPU): the kernel's decoder
only says whether a stream is valid, and on an invalid one the NumPy decoder runs to raise its
:class:`~fedcomp.errors.PayloadError`.

The code
--------
Positions ``idx_0 < idx_1 < ...`` are sent as gaps ``d_k = idx_k - idx_{k-1}`` with
``idx_{-1} = -1`` (so every ``d >= 1``). With the Golomb-Rice parameter ``b``, each gap gives
``q = (d - 1) >> b`` and ``r = (d - 1) & (2**b - 1)``; its codeword is ``q`` one-bits, one
zero-bit, and ``r`` in ``b`` bits, most significant first. These are exactly the codewords of
the paper's Algorithm 3, and the total number of bits is the same.

Layout (a deliberate departure from the paper)
----------------------------------------------
The paper interleaves the codewords (unary part, then remainder, gap after gap). That can only
be parsed serially, because where codeword ``k`` starts depends on every earlier ``q``. fedcomp
lays the same bits out in two sections instead, so decoding is a parallel prefix computation:

1. the **remainders section**: ``nnz * b`` bits, ``r_0, r_1, ...``, each in ``b`` bits MSB first;
2. the **unary section**: for each ``k`` in order, ``q_k`` one-bits then one zero-bit.

The ``k``-th zero bit of the unary section ends codeword ``k``, so ``q_k`` is the distance
between consecutive zero bits, and positions follow from one cumulative sum. The stream is
packed MSB-first into bytes (bit ``i`` is bit ``7 - i % 8`` of byte ``i // 8``) and the last byte
is padded with zero bits: the stream is ``ceil((nnz * b + sum(q) + nnz) / 8)`` bytes, no more.

Decoding trusts nothing: every way a stream can be inconsistent with ``nnz``, ``b`` and the
tensor's ``numel`` raises :class:`~fedcomp.errors.PayloadError`; ``len(bits)`` is checked against
the most a valid stream for ``numel`` elements can need before anything is unpacked, and the
work and memory are then linear in ``8 * len(bits) + nnz`` (a few bytes per bit: the unary
section is located with a stable sort of its bits, which lists the zero bits first).

Both directions avoid per-bit work for the remainders when ``b <= 8`` (the common case, density
above about 0.3 %): eight ``b``-bit remainders are exactly ``b`` bytes, built or split as one
int64 word with shifts.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from fedcomp import _native
from fedcomp.errors import PayloadError

#: The C kernels (:mod:`fedcomp._native`), or None: then the CPU paths run in NumPy.
_KERNEL = _native.load("sbc")

#: Largest Golomb-Rice parameter (remainder width) the format allows.
MAX_B = 62

#: ln(phi - 1), phi the golden ratio.
LN_PHI_MINUS_1 = math.log((math.sqrt(5.0) - 1.0) / 2.0)

#: 0x8040201008040201 as a (wrapping) signed int64, for :func:`_pack_bits`.
_PACK_MAGIC = 0x8040201008040201 - (1 << 64)


def golomb_b(p: float) -> int:
    """The paper's optimal parameter ``b* = 1 + floor(log2(ln(phi - 1) / ln(1 - p)))``.

    ``p`` is the density of non-zeros. The result is clamped to ``[0, 62]``: ``p <= 0`` (the
    limit of ever sparser tensors) gives 62, ``p >= 1`` (every position set) gives 0.
    """
    p = float(p)
    if math.isnan(p):
        raise ValueError("golomb_b: p is NaN")
    if p <= 0.0:
        return MAX_B
    if p >= 1.0:
        return 0
    ratio = LN_PHI_MINUS_1 / math.log1p(-p)
    if ratio <= 0.0 or math.isinf(ratio):  # p below float resolution: log1p(-p) == -0.0
        return MAX_B
    return max(0, min(MAX_B, 1 + math.floor(math.log2(ratio))))


def expected_bits_per_position(p: float, b: int) -> float:
    """Expected code length per position for i.i.d. positions of density ``p``:
    ``b + 1 / (1 - (1 - p) ** (2 ** b))``."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"expected_bits_per_position: p must be in (0, 1], got {p}")
    return b + 1.0 / (1.0 - (1.0 - p) ** (2.0**b))


# --- helpers (all torch, any device) ----------------------------------------------------------


@lru_cache(maxsize=16)
def _bit_table(device: str) -> torch.Tensor:
    """``(256, 8)`` uint8: row ``v`` holds the 8 bits of ``v``, most significant first."""
    v = torch.arange(256, dtype=torch.int64).unsqueeze(1)
    return ((v >> torch.arange(7, -1, -1)) & 1).to(torch.uint8).to(device)


@lru_cache(maxsize=128)
def _group_shifts(b: int, device: str) -> torch.Tensor:
    """``[7 b, 6 b, ..., b, 0]``: where 8 consecutive ``b``-bit remainders sit in one word."""
    return torch.arange(7, -1, -1, dtype=torch.int64, device=device) * b


_ARANGE: dict[str, torch.Tensor] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` (int64), a slice of a cached tensor that grows by doubling."""
    key = str(device)
    cached = _ARANGE.get(key)
    if cached is None or cached.numel() < n:
        size = max(n, 1 << 16, 2 * (0 if cached is None else cached.numel()))
        cached = _ARANGE[key] = torch.arange(size, device=device)
    return cached[:n]


def _pack_bits(stream: torch.Tensor) -> bytes:
    """Pack a fresh 0/1 uint8 tensor whose length is a multiple of 8, MSB first.

    Each group of 8 bytes is read as one little-endian int64 ``w = sum(bit_j << 8 j)``;
    multiplying by ``0x8040201008040201`` moves ``bit_j`` to bit ``63 - j`` without carries
    (all 64 partial products land on distinct bits), so the top byte (byte 7 of each
    little-endian word) is the packed byte.
    """
    words = stream.view(torch.int64) * _PACK_MAGIC
    return words.view(torch.uint8)[7::8].cpu().numpy().tobytes()


def _unpack_bits(data: bytes, device: torch.device) -> torch.Tensor:
    """0/1 uint8 tensor of ``8 * len(data)`` bits, MSB first."""
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device=device, dtype=torch.int64)
    return _bit_table(str(device)).index_select(0, raw).view(-1)


def _pack_remainders(r: torch.Tensor, b: int) -> bytes:
    """The remainders section: each of ``r`` in ``b`` bits, MSB first, concatenated and packed
    into ``ceil(len(r) * b / 8)`` bytes (the last one zero-padded)."""
    nnz = r.numel()
    nbytes = -(-nnz * b // 8)
    if b <= 8:
        # 8 remainders make exactly b bytes: build them as one int64 word per group of 8
        groups = -(-nnz // 8)
        padded = torch.nn.functional.pad(r, (0, groups * 8 - nnz)) if nnz % 8 else r
        words = (padded.view(groups, 8) << _group_shifts(b, str(r.device))).sum(1)
        # the word's low b bytes, most significant first, are the group's b bytes
        out = words.view(torch.uint8).view(groups, 8)[:, :b].flip(1)
        return out.cpu().numpy().tobytes()[:nbytes]
    stream = torch.zeros(nbytes * 8, dtype=torch.uint8, device=r.device)
    bits = stream[: nnz * b].view(nnz, b)
    for lo in range(0, b, 8):  # 8 bits at a time, most significant first
        width = min(8, b - lo)
        shifts = torch.arange(width - 1, -1, -1, dtype=torch.int64, device=r.device) + (b - lo - width)
        bits[:, lo : lo + width] = ((r.unsqueeze(1) >> shifts) & 1).to(torch.uint8)
    return _pack_bits(stream)


def _unpack_remainders(data: bytes, nnz: int, b: int, device: torch.device) -> torch.Tensor:
    """Inverse of :func:`_pack_remainders` (``data`` may hold bits beyond ``nnz * b``)."""
    if b <= 8:
        groups = -(-nnz // 8)
        chunk = bytearray(groups * b)  # zero-padded to whole groups
        head = data[: groups * b]
        chunk[: len(head)] = head
        raw = torch.frombuffer(chunk, dtype=torch.uint8).to(device=device, dtype=torch.int64)
        # each group's b bytes, most significant first, as one word; then its 8 remainders
        words = (raw.view(groups, b) << _group_shifts(8, str(device))[8 - b :]).sum(1, keepdim=True)
        r = (words >> _group_shifts(b, str(device))) & ((1 << b) - 1)
        return r.view(-1)[:nnz]
    bits = _unpack_bits(data[: -(-nnz * b // 8)], device)[: nnz * b].view(nnz, b)
    r = torch.zeros(nnz, dtype=torch.int64, device=device)
    for j in range(b):  # Horner over the b <= 62 bit columns: memory stays at a byte per bit
        r.mul_(2).add_(bits[:, j])
    return r


# --- the code -----------------------------------------------------------------------------------


def encode_positions(idx: torch.Tensor, b: int) -> bytes:
    """Golomb-Rice code sorted, unique, non-negative positions (any device) in the two-section
    layout described in the module docstring."""
    if not 0 <= b <= MAX_B:
        raise ValueError(f"golomb b must be in [0, {MAX_B}], got {b}")
    if idx.device.type == "cpu":
        arr = idx.reshape(-1).numpy().astype(np.int64, copy=False)
        kernel = _KERNEL
        if kernel is not None:
            return bytes(kernel.golomb_encode(np.ascontiguousarray(arr), b))
        return _encode_positions_np(arr, b)
    return _encode_positions_torch(idx, b)


def _encode_positions_torch(idx: torch.Tensor, b: int) -> bytes:
    """:func:`encode_positions` in torch (any device; what CUDA runs)."""
    idx = idx.reshape(-1).to(torch.int64)
    nnz = idx.numel()
    if nnz == 0:
        return b""
    dev = idx.device
    dm1 = idx.clone()  # d - 1 = idx_k - idx_{k-1} - 1, and idx_0 for the first
    dm1[1:].sub_(idx[:-1]).sub_(1)
    rem_len = nnz * b
    head = _pack_remainders(dm1 & ((1 << b) - 1), b) if b else b""
    # The unary section starts at bit rem_len, i.e. `offset` bits into the remainders' last byte:
    # build it with `offset` leading zero bits, pack it, and OR the shared byte.
    offset = rem_len % 8
    ends = torch.cumsum(dm1 >> b, 0)  # q_0 + ... + q_k
    used = offset + int(ends[-1]) + nnz
    stream = torch.ones(-(-used // 8) * 8, dtype=torch.uint8, device=dev)
    if offset:
        stream[:offset] = 0
        ends += offset
    if used % 8:
        stream[used:] = 0
    # codeword k ends with a zero bit at q_0 + ... + q_k + k of the unary section
    stream.index_fill_(0, ends.add_(_arange(nnz, dev)), 0)
    tail = _pack_bits(stream)
    if offset:
        return head[:-1] + bytes([head[-1] | tail[0]]) + tail[1:]
    return head + tail


def decode_positions(
    bits: bytes, nnz: int, b: int, numel: int, name: str, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Decode ``nnz`` positions in ``[0, numel)`` from ``bits`` (int64, ascending, on ``device``).

    Raises :class:`PayloadError` naming ``name`` on any inconsistency: ``nnz`` above ``numel``,
    ``b`` out of range, a stream too short or too long, a unary section that runs out of zero
    bits, non-zero padding, or positions at or beyond ``numel``.
    """
    device = torch.device(device)
    nnz, b, numel = int(nnz), int(b), int(numel)
    check_stream(bits, nnz, b, numel, name)
    if nnz == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    if device.type == "cpu":
        kernel = _KERNEL
        if kernel is not None:
            out = np.empty(nnz, dtype=np.int64)
            if kernel.golomb_decode(bits, nnz, b, numel, out):
                return torch.from_numpy(out)
            # an invalid stream: the NumPy path raises the PayloadError that names what is wrong
        return torch.from_numpy(_decode_positions_np(bits, nnz, b, numel, name))
    return _decode_positions_torch(bits, nnz, b, numel, name, device)


def check_stream(bits: bytes, nnz: int, b: int, numel: int, name: str) -> None:
    """The checks of :func:`decode_positions` that need no decoding (raise :class:`PayloadError`):
    what a caller checks before it hands the stream to a kernel that decodes it."""
    if not 0 <= numel < 1 << 62:
        raise PayloadError(name, f"numel {numel} is out of range")
    if nnz < 0:
        raise PayloadError(name, f"nnz {nnz} is negative")
    if nnz > numel:
        raise PayloadError(name, f"nnz {nnz} exceeds the tensor's {numel} elements")
    if not 0 <= b <= MAX_B:
        raise PayloadError(name, f"golomb_b {b} is outside [0, {MAX_B}]")
    nbytes = len(bits)
    if nnz == 0:
        if nbytes:
            raise PayloadError(name, f"{nbytes} position bytes for nnz 0")
        return
    rem_len = nnz * b
    if nbytes * 8 < rem_len + nnz:
        raise PayloadError(
            name, f"position bits truncated: {nbytes} bytes cannot hold {nnz} codewords of at least {b + 1} bits"
        )
    # A valid stream has sum(q) <= sum(d - 1) <= numel - nnz, so it needs at most nnz*b + numel bits.
    max_bytes = (rem_len + numel + 7) // 8
    if nbytes > max_bytes:
        raise PayloadError(
            name, f"position bits are {nbytes} bytes, more than the {max_bytes} that {numel} elements can need"
        )


def _decode_positions_torch(bits: bytes, nnz: int, b: int, numel: int, name: str, device: torch.device) -> torch.Tensor:
    """The rest of :func:`decode_positions` (arguments checked, ``nnz > 0``) in torch: any device."""
    rem_len = nnz * b
    nbytes = len(bits)
    offset = rem_len % 8
    unary = _unpack_bits(bits[rem_len // 8 :], device)  # from the byte where the unary section starts
    unary[:offset] = 1  # the remainders' bits in that byte are no codeword ends
    # A stable sort of the 0/1 bits lists the zero bits first, in order: the codeword ends.
    # (Faster than nonzero on CPU, and a radix sort on CUDA.)
    ordered, zeros_at = torch.sort(unary, stable=True)
    if nnz > unary.numel() or int(ordered[nnz - 1]) != 0:
        found = int((unary == 0).sum())
        raise PayloadError(name, f"position bitstream runs past its end: {found} of {nnz} codewords are terminated")
    zeros_at = zeros_at[:nnz]
    _check_stream_end(bits, nbytes, (rem_len - offset) + int(zeros_at[-1]) + 1, name)
    q = zeros_at.clone()  # q_k = zeros_at[k] - zeros_at[k - 1] - 1, and zeros_at[0] - offset first
    q[1:].sub_(zeros_at[:-1]).sub_(1)
    q[0] -= offset
    # d = (q << b) + r + 1 must be <= numel; check q first so the shift cannot overflow int64.
    if int(q.max()) > (numel - 1) >> b:
        raise PayloadError(name, f"positions overflow the tensor's {numel} elements")
    d = (q << b).add_(1)
    if b:
        d += _unpack_remainders(bits, nnz, b, device)
    # each d <= numel - 1 + 2**62 < 2**63; the sum wraps only past 2**63, into negative values,
    # so positions are valid iff none is negative and the last (the largest) is below numel
    idx = torch.cumsum(d, 0).sub_(1)
    low, high = torch.stack([idx.min(), idx[-1]]).tolist()
    if low < 0 or high >= numel:
        raise PayloadError(name, f"positions overflow the tensor's {numel} elements")
    return idx


# --- the CPU path: the same code in NumPy ----------------------------------------------------------
#
# NumPy's packbits/unpackbits and flatnonzero replace the bit tables, the multiply-pack and the
# stable sort; every check and message is the torch path's (tests compare both on CPU).


def _pack_remainders_np(r: np.ndarray, b: int) -> bytes:
    """:func:`_pack_remainders` for a NumPy int64 array (``1 <= b``)."""
    nnz = r.shape[0]
    nbytes = -(-nnz * b // 8)
    if b <= 8:  # 8 remainders are b bytes: one int64 word per group of 8, its low b bytes MSB first
        groups = -(-nnz // 8)
        padded = np.zeros(groups * 8, dtype=np.int64)
        padded[:nnz] = r
        words = (padded.reshape(groups, 8) << _NP_SHIFTS[b]).sum(1)
        out = words.view(np.uint8).reshape(groups, 8)[:, b - 1 :: -1]
        return out.tobytes()[:nbytes]
    shifts = np.arange(b - 1, -1, -1, dtype=np.int64)
    return np.packbits(((r[:, None] >> shifts) & 1).astype(np.uint8)).tobytes()


#: ``[7 b, 6 b, ..., 0]`` for b = 0..8 (where 8 consecutive b-bit remainders sit in one word).
_NP_SHIFTS = [np.arange(7, -1, -1, dtype=np.int64) * b for b in range(9)]


def _encode_positions_np(idx: np.ndarray, b: int) -> bytes:
    """:func:`encode_positions` for sorted, unique, non-negative int64 positions in NumPy."""
    nnz = idx.shape[0]
    if nnz == 0:
        return b""
    dm1 = np.empty_like(idx)  # d - 1 = idx_k - idx_{k-1} - 1, and idx_0 for the first
    dm1[0] = idx[0]
    np.subtract(idx[1:], idx[:-1], out=dm1[1:])
    dm1[1:] -= 1
    rem_len = nnz * b
    head = _pack_remainders_np(dm1 & ((1 << b) - 1), b) if b else b""
    offset = rem_len % 8
    ends = np.cumsum(dm1 >> b)  # q_0 + ... + q_k
    used = offset + int(ends[-1]) + nnz
    stream = np.ones(-(-used // 8) * 8, dtype=np.uint8)
    stream[:offset] = 0
    stream[used:] = 0
    ends += np.arange(offset, offset + nnz, dtype=np.int64)  # the zero bit ending codeword k
    stream[ends] = 0
    tail = np.packbits(stream).tobytes()
    if offset:
        return head[:-1] + bytes([head[-1] | tail[0]]) + tail[1:]
    return head + tail


def _unpack_remainders_np(data: bytes, nnz: int, b: int) -> np.ndarray:
    """:func:`_unpack_remainders` in NumPy (``1 <= b``; ``data`` holds at least ``nnz * b`` bits)."""
    if b <= 8:
        groups = -(-nnz // 8)
        chunk = np.zeros(groups * 8, dtype=np.uint8)  # each group's b bytes, right-aligned in a word
        raw = np.frombuffer(data, dtype=np.uint8, count=min(len(data), groups * b))
        view = chunk.reshape(groups, 8)
        flat = np.zeros(groups * b, dtype=np.uint8)
        flat[: raw.shape[0]] = raw
        view[:, b - 1 :: -1] = flat.reshape(groups, b)  # little-endian word: the last byte lowest
        del flat
        r = chunk.view(np.int64).reshape(groups, 1) >> _NP_SHIFTS[b]
        r &= (1 << b) - 1
        return r.reshape(-1)[:nnz]
    nbits = nnz * b
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8, count=-(-nbits // 8)))[:nbits].reshape(nnz, b)
    r = np.zeros(nnz, dtype=np.int64)
    for j in range(b):  # Horner over the bit columns
        r <<= 1
        r += bits[:, j]
    return r


def _decode_positions_np(bits: bytes, nnz: int, b: int, numel: int, name: str) -> np.ndarray:
    """The rest of :func:`decode_positions` (arguments checked, ``nnz > 0``) in NumPy."""
    rem_len = nnz * b
    nbytes = len(bits)
    offset = rem_len % 8
    unary = np.unpackbits(np.frombuffer(bits, dtype=np.uint8, offset=rem_len // 8))
    unary[:offset] = 1  # the remainders' bits in that byte are no codeword ends
    zeros_at = np.flatnonzero(unary == 0)
    if zeros_at.shape[0] < nnz:
        found = zeros_at.shape[0]
        raise PayloadError(name, f"position bitstream runs past its end: {found} of {nnz} codewords are terminated")
    zeros_at = zeros_at[:nnz]
    _check_stream_end(bits, nbytes, (rem_len - offset) + int(zeros_at[-1]) + 1, name)
    # In place from here: two int64 arrays of nnz at most (the decoder's memory bound).
    q = np.empty(nnz, dtype=np.int64)  # q_k = zeros_at[k] - zeros_at[k - 1] - 1, zeros_at[0] - offset first
    q[0] = zeros_at[0] - offset
    np.subtract(zeros_at[1:], zeros_at[:-1], out=q[1:])
    del zeros_at, unary
    q[1:] -= 1
    if int(q.max()) > (numel - 1) >> b:
        raise PayloadError(name, f"positions overflow the tensor's {numel} elements")
    d = q
    d <<= b
    d += 1
    if b:
        d += _unpack_remainders_np(bits, nnz, b)
    with np.errstate(over="ignore"):
        idx = np.cumsum(d, out=d)  # wraps past 2**63 into negative values, like torch's
    idx -= 1
    if int(idx.min()) < 0 or int(idx[-1]) >= numel:
        raise PayloadError(name, f"positions overflow the tensor's {numel} elements")
    return idx


def _check_stream_end(bits: bytes, nbytes: int, end: int, name: str) -> None:
    """The stream's last codeword ends at bit ``end`` (bits used): it must fill exactly the bytes
    it needs, with zero padding bits (one canonical encoding per position list)."""
    canonical = (end + 7) // 8
    if canonical != nbytes:
        raise PayloadError(name, f"{nbytes - canonical} trailing bytes after the position bitstream")
    if end % 8 and bits[-1] & (0xFF >> (end % 8)):
        raise PayloadError(name, "non-zero padding bits after the position bitstream")
