"""3LC (Lim, Andersen, Kaminsky, MLSys 2019): the downlink codec for model deltas.

Three steps, exactly as in the paper (section 3):

1. **3-value quantization with sparsity multiplier** ``s`` (``1 <= s < 2``)::

       m = s * max|T|                       (float32; 0 when T is all zero)
       q = round(T / m)  in {-1, 0, 1}      (true float32 division, round half to even)
       T_out = m * q

   ``round`` is :func:`torch.round`, i.e. round half to even, so ``T / m == +-0.5`` gives 0.
   With ``|T| <= m`` this keeps ``|T - T_out| <= m / 2 < max|T|``. ``m`` is computed as the
   float32 product of ``float32(s)`` and ``max|T|``; if that overflows (``max|T|`` within a factor
   ``s`` of the float32 maximum) ``m`` is clamped to the float32 maximum, which keeps
   ``|T| <= m``. Non-finite input (NaN or inf) cannot be coded and raises :class:`ValueError`.
   The division is a true division by a tensor on the input's device, never a multiplication by
   ``1 / m``, so CPU and CUDA produce the same bytes.

2. **Base-3^5 packing**: add 1 (digits 0, 1, 2), flatten, pad with the digit 0 to a multiple of
   5, split into five equal contiguous parts ``P0..P4`` of ``G = ceil(n / 5)`` digits each, and
   emit ``81*P0 + 27*P1 + 9*P2 + 3*P3 + P4`` (a byte in 0..242; five zero values give 121).
   Without zero-run encoding that is exactly ``ceil(n / 5)`` bytes, 1.6 bits per value.

3. **Zero-run encoding** (optional, on by default): bytes 243..255 stand for runs of the byte 121,
   the byte ``v`` for ``v - 241`` of them (243 = two 121s, ..., 255 = fourteen). A *maximal* run of
   ``L`` consecutive 121 bytes is written greedily, left to right, as ``L // 14`` bytes 255
   followed by the remainder ``r = L % 14``: one byte ``243 + (r - 2)`` if ``r >= 2``, a single
   121 if ``r == 1``, nothing if ``r == 0``. Every other byte is copied. The encoding is
   therefore canonical (one output per input). An all-zero float32 tensor of ``70 k`` values
   becomes ``k`` bytes: the 280x bound of the paper.

Decoding reverses the steps. A payload is checked against the expected shape before anything
of the tensor's size is allocated: ``numel`` must match, ``scale`` must be finite and ``>= 0``,
the data must be exactly ``ceil(n / 5)`` bytes (without zero runs; bytes above 242 are then
rejected) or expand to exactly that many (with zero runs; the expanded length is computed from
the compressed bytes first). Anything else is a :class:`PayloadError` naming the tensor.

What runs where: on CPU, the C kernels of ``fedcomp/_native/threelc.c`` when they are built and
not switched off (``fedcomp._native.load("threelc")``, ``FEDCOMP_NATIVE=0``), else NumPy; on
other devices (CUDA), vectorized torch. All three give the same bytes, reconstruction and
decoded values, bit for bit (tested against each other and the plain-Python reference).

With the kernels, encoding a tensor is one C call (:meth:`ThreeLC._payload_native`); one read
finds ``max|T|`` (as magnitude bits, with the non-finite check) and, chunk by chunk, the
positions at or above ``0.49 * s * running max`` (a superset of the values that become +-1);
``m`` and the threshold are those of :func:`scale_for` and :func:`round_threshold`; a sparse
tensor (the usual model delta) is then packed and zero-run coded from those positions alone,
straight into a buffer of ``ceil(n / 5)`` bytes (a zero-run stream is never longer), and a
denser one by a second, fused quantize + pack + zero-run pass in blocks of 64 groups. The
reconstruction, when asked for, is written only where ``q != 0`` into fresh zeros. Tensors of
``_PARALLEL_VALUES`` values or more are split into ranges on the CPU threads
(:func:`_encode_split`; the zero runs at the ranges' ends are joined). Decoding checks the
expanded length first, then one C pass expands the runs, unpacks and scales into fresh zeros,
writing only the groups other than 121; on any inconsistency the NumPy decoder runs instead and
raises its :class:`PayloadError`. A subnormal ``m`` without a threshold takes the NumPy path.
A whole update's large tensors are encoded and decoded several at once, one per CPU thread
(``tensor_parallel``: :class:`fedcomp.methods.update.UpdateEncoder` and
:func:`fedcomp.methods.update.decode_update` run them in :func:`fedcomp.codecs.sbc.run_jobs`' lanes,
where the split into ranges runs serially): the same bytes and values as a loop, tested.

Without the kernels, the CPU hot paths run in NumPy and quantize without dividing: correctly
rounded division is monotone, so ``round(x / m) == 1`` exactly when ``x >= t`` for one float32 threshold ``t``
(:func:`round_threshold`, found next to ``m / 2``), and -1 exactly when ``x <= -t``; two
compares per value then give the same bytes and reconstruction as the division, bit for bit
(tested against the torch path on CPU). Packing accumulates the digits in uint8, and decoding
takes the digits off each byte by division by 3. Neither allocates more than a few bytes per
group of a chunk beyond its output. The whole CPU path is NumPy, never torch's CPU kernels
(their OpenMP regions slow down many-fold on a loaded machine). Encoding reads the tensor once
for ``max|T|`` and, in the same pass, the candidates for +-1 (:func:`_scan_cpu`); a sparse
tensor is packed from those alone and zero-run coded from its groups that are not 121, a dense
one takes a second read (the fused quantize + pack). Both passes are split into ranges run on
the CPU threads (:func:`fedcomp.codecs.sbc.split_run`). Decoding a sparse stream (at most one
group in ``_SPARSE_DECODE`` other than 121, the usual case for a model delta) skips the
expansion: the output is fresh zeros and the five values of each listed group are scattered; a
denser stream is expanded and unpacked.

On other devices everything is vectorized torch (no Python loop over elements or bytes). The
hot paths (quantize + pack + reconstruction on encode, unpack + scale on decode) walk the
tensor in chunks of groups, handling the five parts of a chunk together as a (5, width) float32
buffer that stays in cache; so the input is read twice on encode (max|T|,
then quantize), the float32 reconstruction or output is written once, and no temporary of the
tensor's size is made. Zero-run encoding works on the positions of the bytes that are not 121
(few, for sparse updates); decoding on the compressed bytes. The module-level helpers
(:func:`quantize`, :func:`pack_base243`, :func:`unpack_base243`, :func:`zero_run_encode`,
:func:`zero_run_decode`) are the unfused steps, for tests and benchmarks. A whole update on such a
device goes through :mod:`fedcomp.codecs.threelc_device` instead (what
:class:`fedcomp.methods.update.UpdateEncoder` and :func:`fedcomp.methods.update.decode_update`
run there): each step once for all tensors, the same bytes and values.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch

from fedcomp import _native
from fedcomp.codecs.base import Codec, TensorSpec, check_wire_dtype, expect_payload
from fedcomp.codecs.sbc import split_run
from fedcomp.errors import ConfigError, PayloadError, check_number
from fedcomp.wire.payloads import EncodedTensor, Payload, ThreeLCPayload

#: Weights of the five parts in one byte.
WEIGHTS = (81, 27, 9, 3, 1)
#: The byte of five zero values.
ZERO_GROUP = 121
#: First zero-run byte (a run of two 121s); 255 is a run of fourteen.
RUN_BASE = 243
MAX_RUN = 14

#: The C kernels (``fedcomp/_native/threelc.c``), or None: then the CPU paths run in NumPy.
_KERNEL = _native.load("threelc")

_WEIGHTS_F32 = torch.tensor(WEIGHTS, dtype=torch.float32)
#: Byte for the last piece of a run of r 121s, r = 1..14 (index 0 unused).
_LAST_PIECE = torch.tensor([0, ZERO_GROUP] + [RUN_BASE + r - 2 for r in range(2, MAX_RUN + 1)], dtype=torch.uint8)

_LAST_PIECE_NP = _LAST_PIECE.numpy()
_WEIGHTS_NP = np.array(WEIGHTS, dtype=np.int16)
#: On CPU, a tensor with at most one value in this many quantized to +-1 is packed sparsely.
_SPARSE_ENCODE = 32
#: On CPU, a stream with at most one group in this many other than 121 is decoded sparsely.
_SPARSE_DECODE = 4
#: Values per chunk of the encoder's scan (:func:`_scan_cpu`): 1 MB, large enough that the Python
#: cost per chunk is small, small enough to stay in cache for the second look.
_SCAN_CHUNK = 1 << 18
#: A tensor's groups are split among the CPU threads one range per this many groups.
_PARALLEL_GROUPS = 1 << 17
#: With the C kernels, a tensor of at least this many values is encoded on the CPU threads.
_PARALLEL_VALUES = 1 << 19

_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_TINY = np.float32(torch.finfo(torch.float32).tiny)  # the least normal float32
# Groups per chunk on CPU: the five parts' slices of this many values stay in cache.
_CPU_CHUNK = 1 << 15
_DEV_CHUNK = 1 << 22
# The torch path's buffers are ~44 bytes per group of a chunk: a chunk of a tensor is at most a
# quarter of its groups (unless that is below this floor), so decoding allocates at most about
# half the tensor's own size beyond its output, whatever _DEV_CHUNK is.
_MIN_WIDTH = 1 << 12


def _chunk(device: torch.device) -> int:
    return _CPU_CHUNK if device.type == "cpu" else _DEV_CHUNK


def _width(g: int, device: torch.device) -> int:
    """Groups per chunk for a tensor of ``g`` groups: the device's chunk, capped by the tensor."""
    return max(1, min(_chunk(device), g, max(-(-g // 4), _MIN_WIDTH)))


def groups(numel: int) -> int:
    """Number of base-3^5 bytes (groups of five values) for ``numel`` values."""
    return (numel + 4) // 5


# --- quantization ---------------------------------------------------------------------------------


def max_abs(flat: torch.Tensor, name: str = "") -> float:
    """``max|flat|`` as a Python float (0.0 for an empty tensor); ValueError if not finite."""
    if flat.numel() == 0:
        return 0.0
    lo, hi = torch.stack(torch.aminmax(flat)).tolist()  # one pass, one device sync
    value = max(abs(lo), abs(hi))
    if not math.isfinite(value):
        raise ValueError(f"tensor {name!r}: 3LC cannot encode non-finite values (max|T| = {value})")
    return value


def scale_for(maxabs: float, s: float) -> float:
    """``m = float32(float32(s) * float32(max|T|))``, clamped to the float32 maximum."""
    with np.errstate(over="ignore"):
        m = float(np.float32(s) * np.float32(maxabs))  # float32 arithmetic, rounded once
    return _F32_MAX if math.isinf(m) else m


def quantize(flat: torch.Tensor, s: float = 1.0) -> tuple[torch.Tensor, float]:
    """3-value quantization: ``(q, m)`` with ``q = round(flat / m)`` as int8 in {-1, 0, 1}.

    The straightforward form (one full-size float temporary); the codec fuses the same
    computation with packing. ``m`` is a Python float holding a float32 value.
    """
    flat = flat.reshape(-1).to(torch.float32)
    m = scale_for(max_abs(flat), s)
    if m == 0.0:
        return torch.zeros(flat.numel(), dtype=torch.int8, device=flat.device), m
    m_t = torch.tensor(m, dtype=torch.float32, device=flat.device)
    return torch.round(flat / m_t).to(torch.int8), m


# --- base-3^5 packing -----------------------------------------------------------------------------


def pack_base243(q: torch.Tensor) -> torch.Tensor:
    """Pack int values in {-1, 0, 1} five to a byte (see the module docstring); uint8, ``ceil(n/5)``."""
    q = q.reshape(-1)
    n = q.numel()
    g = groups(n)
    digits = torch.zeros(5 * g, dtype=torch.uint8, device=q.device)  # padding digit 0
    digits[:n] = (q.to(torch.int8) + 1).view(torch.uint8)
    parts = digits.view(5, g)
    out = parts[0].clone()
    for k in range(1, 5):
        out.mul_(3).add_(parts[k])
    return out


def unpack_base243(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_base243`: int8 values in {-1, 0, 1}, ``numel`` of them."""
    packed = packed.reshape(-1)
    g = groups(numel)
    if packed.numel() != g:
        raise ValueError(f"{packed.numel()} bytes where {g} were expected for {numel} values")
    if g and int(packed.max()) > RUN_BASE - 1:
        raise ValueError(f"byte {int(packed.max())} is not a base-3^5 code (0..242)")
    digits = torch.empty(5, g, dtype=torch.int8, device=packed.device)
    rest = packed.clone()
    for k in range(4, -1, -1):
        digits[k] = (rest % 3).view(torch.int8)
        rest.div_(3, rounding_mode="floor")
    return (digits.reshape(-1)[:numel] - 1).to(torch.int8)


def _rows(t: torch.Tensor, g: int, a: int, rows: int, width: int) -> torch.Tensor:
    """View of ``t[k*g + a : k*g + a + width]`` for ``k < rows`` as a (rows, width) tensor."""
    return t.as_strided((rows, width), (g, 1), t.storage_offset() + a)


def _full_rows(n: int, g: int, a: int, width: int) -> int:
    """How many of the parts P0, P1, ... have all of ``[a, a + width)`` inside the tensor."""
    return min(5, max(0, (n - a - width) // g + 1))


def _quantize_pack(flat: torch.Tensor, m: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``pack_base243(quantize(flat))`` plus the reconstruction ``m * q``, for ``m > 0``.

    Works in chunks of groups ``[a, a + width)``: the five parts' slices are divided by ``m`` into
    a (5, width) float buffer (padding gets q = -1, i.e. the digit 0), rounded, written scaled to
    the reconstruction, and folded into bytes by one matrix-vector product with the weights:
    ``sum_k w_k q_k`` is in -121..121 and exact in float32, and the byte is that plus 121.
    """
    n = flat.numel()
    g = groups(n)
    dev = flat.device
    flat = flat.contiguous()
    recon = torch.empty(n, dtype=torch.float32, device=dev)
    packed = torch.empty(g, dtype=torch.uint8, device=dev)
    m_t = torch.tensor(m, dtype=torch.float32, device=dev)
    w_t = _WEIGHTS_F32.to(dev)
    width_max = _width(g, dev)
    fbuf = torch.empty(5 * width_max, dtype=torch.float32, device=dev)
    acc_buf = torch.empty(width_max, dtype=torch.float32, device=dev)
    i8_buf = torch.empty(width_max, dtype=torch.int8, device=dev)
    for a in range(0, g, width_max):
        width = min(width_max, g - a)
        f = fbuf[: 5 * width].view(5, width)
        full = _full_rows(n, g, a, width)
        if full:
            torch.div(_rows(flat, g, a, full, width), m_t, out=f[:full])
        part = 0
        if full < 5:  # the tensor ends inside part `full`; the rest is padding
            lo = full * g + a
            part = max(0, min(width, n - lo))
            if part:
                torch.div(flat[lo : lo + part], m_t, out=f[full, :part])
            f[full, part:].fill_(-1.0)
            f[full + 1 :].fill_(-1.0)
        f.round_()
        f.add_(0.0)  # -0.0 -> +0.0, so the reconstruction has the decoder's bits
        if full:
            torch.mul(f[:full], m_t, out=_rows(recon, g, a, full, width))
        if part:
            lo = full * g + a
            torch.mul(f[full, :part], m_t, out=recon[lo : lo + part])
        acc = acc_buf[:width]
        torch.mv(f.t(), w_t, out=acc)
        i8 = i8_buf[:width]
        i8.copy_(acc)
        torch.add(i8.view(torch.uint8), ZERO_GROUP, out=packed[a : a + width])  # wraps mod 256
    return packed, recon


def _zero_packed(n: int, device: torch.device) -> torch.Tensor:
    """``pack_base243`` of ``n`` zeros without materializing them: 121s, minus the padding."""
    g = groups(n)
    packed = torch.full((g,), ZERO_GROUP, dtype=torch.uint8, device=device)
    for p in range(n, 5 * g):  # at most four padding digits (0 instead of 1)
        k, j = divmod(p, g)
        packed[j] -= WEIGHTS[k]
    return packed


def _unpack_scale(packed: torch.Tensor, numel: int, scale: float, device: torch.device) -> torch.Tensor:
    """Fused ``scale * unpack_base243(packed, numel)`` as float32: NumPy on CPU, torch elsewhere
    (the same values, bit for bit; bytes must be <= 242, checked by the caller)."""
    if device.type == "cpu":
        out = torch.empty(numel, dtype=torch.float32)
        if numel:
            _unpack_scale_cpu(packed.reshape(-1).cpu().numpy(), scale, out.numpy())
        return out
    return _unpack_scale_torch(packed, numel, scale, device)


def _unpack_scale_torch(packed: torch.Tensor, numel: int, scale: float, device: torch.device) -> torch.Tensor:
    """Fused ``scale * unpack_base243(packed, numel)`` as float32, in chunks of groups.

    With ``F_k = floor(byte / w_k)`` (exact in float32 for bytes <= 255), the digits are
    ``d_0 = F_0`` and ``d_k = F_k - 3 F_(k-1)``, computed for all five parts at once into a
    (5, width) buffer. Bytes must be <= 242 (checked by the caller).
    """
    g = groups(numel)
    out = torch.empty(numel, dtype=torch.float32, device=device)
    if numel == 0:
        return out
    packed = packed.to(device)
    s_t = torch.tensor(scale, dtype=torch.float32, device=device)
    w_col = _WEIGHTS_F32.to(device).view(5, 1)
    width_max = _width(g, device)
    b_buf = torch.empty(width_max, dtype=torch.float32, device=device)
    f_buf = torch.empty(5 * width_max, dtype=torch.float32, device=device)
    q_buf = torch.empty(5 * width_max, dtype=torch.float32, device=device)
    for a in range(0, g, width_max):
        width = min(width_max, g - a)
        b = b_buf[:width]
        b.copy_(packed[a : a + width])
        f = f_buf[: 5 * width].view(5, width)
        q = q_buf[: 5 * width].view(5, width)
        torch.div(b.unsqueeze(0), w_col, out=f)
        f.floor_()
        torch.sub(f[0], 1.0, out=q[0])
        torch.sub(f[1:], f[:-1], alpha=3, out=q[1:])
        q[1:].sub_(1.0)
        full = _full_rows(numel, g, a, width)
        if full:
            torch.mul(q[:full], s_t, out=_rows(out, g, a, full, width))
        if full < 5:
            lo = full * g + a
            part = max(0, min(width, numel - lo))
            if part:
                torch.mul(q[full, :part], s_t, out=out[lo : lo + part])
    return out


# --- the CPU path: NumPy, compares instead of divisions -------------------------------------------


def round_threshold(m: float) -> np.float32 | None:
    """The least float32 ``t > 0`` with ``round(float32(t / m)) == 1`` (true float32 division,
    round half to even), for ``m > 0``; None if not found within a few steps (never for a
    normal ``m``).

    Correctly rounded division is monotone in the dividend and odd in it, and ``|x / m| <= 1``
    for every input (``m >= max|x|``), so for every float32 ``x`` of the tensor,
    ``round(x / m)`` is 1 iff ``x >= t``, -1 iff ``x <= -t``, else 0: the quantization becomes
    two compares, bit for bit the division's result. ``t`` starts at ``m / 2`` (exact for normal
    ``m``) and is walked one float32 step at a time to the boundary.
    """
    m32 = np.float32(m)
    half = np.float32(0.5)
    t = np.float32(m32 * half)
    with np.errstate(all="ignore"):
        for _ in range(64):
            if t / m32 > half:  # inside: step down while the step below is still inside
                down = np.nextafter(t, np.float32(0.0))
                if not down / m32 > half:
                    return t if t > 0 else None
                t = down
            else:
                t = np.nextafter(t, np.float32(np.inf))
    return None


def _quantize_pack_cpu(a: np.ndarray, t: np.float32, m: float, recon: np.ndarray | None) -> np.ndarray:
    """``pack_base243(quantize(a))`` for float32 ``a`` (n > 0) by compares against the threshold
    ``t`` of :func:`round_threshold`; fills ``recon`` (float32, n) with ``m * q`` when given.

    Works on chunks of ``_CPU_CHUNK`` groups. Per part ``k``, ``ge = a >= t`` and
    ``le = a <= -t`` (0/1 bytes) give ``q = ge - le``; the byte is the base-3 Horner sum of the
    digits ``q + 1``, accumulated in uint8 as ``sum w_k (ge_k - le_k)`` (wrapping mod 256 on the
    way) plus 121 at the end: exact, since the true value is in 0..242. Padding (digit 0) counts
    as ``le = 1``. Large tensors are split into ranges of groups coded by the CPU threads
    (:func:`fedcomp.codecs.sbc.split_run`); each range writes only its own bytes and values.
    """
    g = groups(a.shape[0])
    packed = np.empty(g, dtype=np.uint8)
    split_run(lambda g0, g1: _quantize_pack_range(a, t, m, recon, packed, g0, g1), g, _CPU_CHUNK, _PARALLEL_GROUPS)
    return packed


def _quantize_pack_range(
    a: np.ndarray, t: np.float32, m: float, recon: np.ndarray | None, packed: np.ndarray, g0: int, g1: int
) -> None:
    """:func:`_quantize_pack_cpu` for the groups ``[g0, g1)``: writes ``packed[g0:g1]`` and the
    values of those groups in ``recon``."""
    n = a.shape[0]
    g = packed.shape[0]
    width_max = max(1, min(_CPU_CHUNK, g1 - g0))
    ge = np.empty(width_max, dtype=np.bool_)
    le = np.empty(width_max, dtype=np.bool_)
    q8 = np.empty(width_max, dtype=np.int8)
    neg_t = -t
    m32 = np.float32(m)
    for a0 in range(g0, g1, width_max):
        width = min(width_max, g1 - a0)
        acc = packed[a0 : a0 + width]
        for k in range(5):
            lo = k * g + a0
            part = max(0, min(width, n - lo))  # values of part k in this chunk; the rest is padding
            gek, lek = ge[:width], le[:width]
            if part:
                np.greater_equal(a[lo : lo + part], t, out=gek[:part])
                np.less_equal(a[lo : lo + part], neg_t, out=lek[:part])
            if part < width:
                gek[part:] = False
                lek[part:] = True
            if k == 0:
                np.subtract(gek.view(np.uint8), lek.view(np.uint8), out=acc)
            else:
                np.multiply(acc, 3, out=acc)
                np.add(acc, gek.view(np.uint8), out=acc)
                np.subtract(acc, lek.view(np.uint8), out=acc)
            if recon is not None and part:
                q = q8[:part]
                np.subtract(gek[:part].view(np.int8), lek[:part].view(np.int8), out=q)
                np.multiply(q, m32, out=recon[lo : lo + part])
        np.add(acc, ZERO_GROUP, out=acc)


def _unpack_scale_cpu(packed: np.ndarray, scale: float, out: np.ndarray) -> None:
    """``out = scale * unpack_base243(packed, out.size)`` in float32 (bytes <= 242), in chunks.

    The digits come off each byte by division by 3 (last part first); ``q = digit - 1`` is
    widened to float32 and multiplied by ``float32(scale)``: the same float32 products as the
    torch path (``-1 * 0.0`` is ``-0.0`` there too). Ranges of groups run on the CPU threads.
    """
    g = groups(out.shape[0])
    with np.errstate(over="ignore"):
        s32 = np.float32(scale)
    split_run(lambda g0, g1: _unpack_scale_range(packed, s32, out, g0, g1), g, _CPU_CHUNK, _PARALLEL_GROUPS)


def _unpack_scale_range(packed: np.ndarray, s32: np.float32, out: np.ndarray, g0: int, g1: int) -> None:
    """:func:`_unpack_scale_cpu` for the groups ``[g0, g1)``."""
    n = out.shape[0]
    g = groups(n)
    width_max = max(1, min(_CPU_CHUNK, g1 - g0))
    rest = np.empty(width_max, dtype=np.uint8)
    quot = np.empty(width_max, dtype=np.uint8)
    dig = np.empty(width_max, dtype=np.uint8)
    for a0 in range(g0, g1, width_max):
        width = min(width_max, g1 - a0)
        r, qt, d = rest[:width], quot[:width], dig[:width]
        np.copyto(r, packed[a0 : a0 + width])
        for k in range(4, -1, -1):
            np.floor_divide(r, 3, out=qt)
            lo = k * g + a0
            part = max(0, min(width, n - lo))
            if part:
                np.multiply(qt[:part], 3, out=d[:part])
                np.subtract(r[:part], d[:part], out=d[:part])
                np.subtract(d[:part], 1, out=d[:part])  # digit - 1, wrapping: int8 -1, 0, 1
                dst = out[lo : lo + part]
                np.copyto(dst, d[:part].view(np.int8), casting="unsafe")
                np.multiply(dst, s32, out=dst)
            r, qt = qt, r


# --- zero-run encoding ----------------------------------------------------------------------------


def zero_run_encode(packed: torch.Tensor) -> torch.Tensor:
    """Replace runs of the byte 121 by run bytes 243..255 (rule in the module docstring).

    Vectorized over the ``K`` bytes that are not 121 rather than over the input: their
    positions split the input into ``K + 1`` gaps (maximal runs of 121, possibly empty) of
    lengths ``L_i``. Gap ``i`` becomes ``c_i = ceil(L_i / 14)`` bytes: 255s, the last one being
    the remainder piece of ``r_i = L_i - 14 (c_i - 1)`` (1..14) 121s, coded ``241 + r_i``, or 121
    when ``r_i == 1``; each gap but the last is followed by its non-121 byte. The output is
    filled with 255, then two scatters place the last pieces and the non-121 bytes. Over the
    input there is one uint8 subtraction and the scan for non-zeros; index arithmetic is int64
    of size ``K``.
    """
    x = packed.reshape(-1)
    g = x.numel()
    dev = x.device
    pos = torch.nonzero(x - ZERO_GROUP).reshape(-1)  # uint8 difference: non-zero where x != 121
    k = pos.numel()
    if k == g:  # no 121 at all
        return x.clone()
    bounds = torch.cat([pos.new_tensor([-1]), pos, pos.new_tensor([g])])
    gap = torch.diff(bounds).sub_(1)  # L_i, i = 0..K
    nbytes = torch.div(gap + (MAX_RUN - 1), MAX_RUN, rounding_mode="floor")  # c_i
    # Output with one leading dummy byte: gap i's last piece lands at ends_i - 1 and its
    # following byte at ends_i. An empty gap's "last piece" lands on the dummy or on the
    # previous non-121 byte, which the second scatter then writes.
    ends = torch.cumsum(nbytes.add_(1), 0)  # nbytes now c_i + 1
    total = int(ends[-1])  # the dummy and the output
    out = torch.full((total,), RUN_BASE + MAX_RUN - 2, dtype=torch.uint8, device=dev)  # 255
    rem = gap.add_(2 * MAX_RUN).sub_(nbytes, alpha=MAX_RUN)  # r_i = L_i - 14 (c_i - 1), 14 when L_i = 0
    out[ends - 1] = _LAST_PIECE.to(dev)[rem]
    if k:
        out[ends[:-1]] = x[pos]
    return out[1:]


def _zero_run_encode_np(x: np.ndarray) -> np.ndarray:
    """:func:`zero_run_encode` of a uint8 NumPy array, in NumPy (the CPU path; same bytes)."""
    pos = np.flatnonzero(x != ZERO_GROUP)
    if pos.shape[0] == x.shape[0]:  # no 121 at all
        return x.copy()
    return _zero_run_from_literals(pos, x[pos], x.shape[0])


def _zero_run_from_literals(pos: np.ndarray, vals: np.ndarray, g: int) -> np.ndarray:
    """:func:`zero_run_encode` of the ``g`` bytes that are 121 except ``vals`` (not 121) at the
    ascending positions ``pos``: the gaps between them become run bytes."""
    k = pos.shape[0]
    bounds = np.empty(k + 2, dtype=np.int64)
    bounds[0], bounds[-1] = -1, g
    bounds[1:-1] = pos
    gap = np.diff(bounds)
    gap -= 1  # L_i
    nbytes = (gap + (MAX_RUN - 1)) // MAX_RUN + 1  # c_i + 1
    ends = np.cumsum(nbytes)
    out = np.full(int(ends[-1]), RUN_BASE + MAX_RUN - 2, dtype=np.uint8)  # a leading dummy byte, then 255s
    gap += 2 * MAX_RUN
    gap -= MAX_RUN * nbytes  # r_i, 14 when L_i = 0
    out[ends - 1] = _LAST_PIECE_NP[gap]
    if k:
        out[ends[:-1]] = vals
    return out[1:]


def _scan_cpu(a: np.ndarray, s: float, limit: int) -> tuple[float, np.ndarray | None]:
    """``max|a|`` and, in the same read of ``a``, a superset of the values that 3LC will
    quantize to +-1: ascending positions, or None past ``limit`` of them (or when the running
    maximum is 0 or subnormal). ``max|a|`` is NaN or infinite when ``a`` is not finite.

    Each chunk of ``_SCAN_CHUNK`` values (it stays in cache) has its min and max taken (one
    read from memory; two reductions are cheaper than an absolute value written out) and, when
    one reaches the bound, is made absolute and its values at or above
    ``0.49 * min(s * running max, float32 max)`` kept. The final ``m = s * max|a|`` (clamped to
    the float32 maximum) is at least that ``min`` and the final threshold
    (:func:`round_threshold`) is ``m / 2`` within a float32 step, so nothing the final
    threshold selects is missed. Ranges run on the CPU
    threads, each with its own running maximum (never above the global one).
    """
    s32 = float(np.float32(s))

    def scan(begin: int, end: int) -> tuple[float, list[np.ndarray] | None]:
        width = max(1, min(_SCAN_CHUNK, end - begin))  # an empty range (small n, large chunks) finds nothing
        buf = np.empty(width, dtype=np.float32)
        mask = np.empty(width, dtype=np.bool_)
        running, bound = 0.0, np.float32(0.0)
        found: list[np.ndarray] | None = []
        count = 0
        for c0 in range(begin, end, width):
            c = a[c0 : min(end, c0 + width)]
            lo, hi = float(c.min()), float(c.max())  # NaN propagates through both
            if not (math.isfinite(lo) and math.isfinite(hi)):
                return (math.nan if math.isnan(lo) or math.isnan(hi) else math.inf), None
            top = max(-lo, hi)
            if top > running:
                running = top
                bound = np.float32(0.49 * min(s32 * running, _F32_MAX))  # m is clamped there
                if not bound > _F32_TINY:  # a zero or subnormal bound would keep nearly everything
                    found = None
            if found is None or running == 0.0 or top < bound:  # the last: nothing here reaches it
                continue
            b, m = buf[: c.shape[0]], mask[: c.shape[0]]
            np.abs(c, out=b)
            np.greater_equal(b, bound, out=m)
            idx = m.nonzero()[0]
            count += idx.shape[0]
            if count > limit:
                found = None
                continue
            if idx.shape[0]:
                idx += c0
                found.append(idx)
        return running, found

    parts = split_run(scan, a.shape[0], _SCAN_CHUNK)
    tops = [top for top, _ in parts]
    if any(math.isnan(top) for top in tops):
        return math.nan, None
    top = max(tops)
    if not math.isfinite(top) or any(found is None for _, found in parts):
        return top, None
    pos = [i for _, found in parts if found for i in found]
    return top, np.concatenate(pos) if pos else np.zeros(0, dtype=np.int64)


def _pack_sparse_cpu(a: np.ndarray, pos: np.ndarray, t: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """The packed bytes of ``quantize(a)`` (threshold ``t`` of :func:`round_threshold`) as the
    ascending positions of the groups that are not 121 and their bytes, from ``pos``: ascending
    positions of a superset of the values with ``|x| >= t`` (exactly those with ``q = +-1``,
    ``q = sign(x)``).

    Each such value adds ``w_k q`` to the byte of its group, as do the padding digits
    (``q = -1``). A group's byte is 121 only when all its five ``q`` are 0 (base-3 digits are
    unique), so the groups listed are exactly the bytes that are not 121.
    """
    n = a.shape[0]
    g = groups(n)
    v = a[pos]
    keep = np.abs(v) >= t
    pos, v = pos[keep], v[keep]
    contrib = np.where(v > 0, 1, -1).astype(np.int16)
    pad = np.arange(n, 5 * g, dtype=np.int64)  # padding: digit 0, q = -1
    pos = np.concatenate([pos, pad])
    contrib = np.concatenate([contrib, np.full(pad.shape[0], -1, dtype=np.int16)])
    part = pos // g
    contrib *= _WEIGHTS_NP[part]
    group = pos - part * g
    # positions ascend within each part: a stable sort by group merges the five runs
    order = np.argsort(group, kind="stable")
    group, contrib = group[order], contrib[order]
    if group.shape[0] == 0:
        return group, np.zeros(0, dtype=np.uint8)
    starts = np.flatnonzero(np.diff(group, prepend=-1))
    byte = np.add.reduceat(contrib, starts)
    byte += ZERO_GROUP
    return group[starts], byte.astype(np.uint8)


def _fill_sparse_recon(a: np.ndarray, t: np.float32, m: float, at: np.ndarray, g: int, out: np.ndarray) -> None:
    """Write ``m * q`` into zero-filled ``out`` for the values of the groups ``at`` (every value
    with ``q != 0`` lies in one of them): the same float32 bits as the dense path's."""
    n = a.shape[0]
    m32 = np.float32(m)
    for k in range(5):
        pos = at + k * g
        pos = pos[pos < n]
        v = a[pos]
        q = (v >= t).astype(np.int8) - (v <= -t).astype(np.int8)
        out[pos] = q * m32


def _literals_np(x: np.ndarray, expected_len: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of a zero-run stream that are not 121 and their positions in its expansion
    (which must be ``expected_len`` bytes long, else :class:`PayloadError`): everything between
    them expands to 121s. Work and memory are linear in ``len(x)``, not in the expansion."""
    is_run = x >= RUN_BASE
    counts = x.astype(np.int64)
    counts -= RUN_BASE - 2
    np.copyto(counts, 1, where=~is_run)
    ends = np.cumsum(counts)
    total = int(ends[-1]) if ends.shape[0] else 0
    if total != expected_len:
        raise PayloadError(name, f"zero runs expand to {total} groups, expected {expected_len}")
    literal = np.flatnonzero(~is_run & (x != ZERO_GROUP))
    return (ends[literal] - 1), x[literal]


def _zero_run_decode_np(x: np.ndarray, expected_len: int, name: str) -> np.ndarray:
    """:func:`zero_run_decode` of a uint8 NumPy array, in NumPy (the CPU path; same result)."""
    pos, vals = _literals_np(x, expected_len, name)
    out = np.full(expected_len, ZERO_GROUP, dtype=np.uint8)
    out[pos] = vals
    return out


def _sparse_unpack_scale_np(pos: np.ndarray, vals: np.ndarray, numel: int, scale: float) -> np.ndarray:
    """``scale * unpack_base243(packed, numel)`` for a packed stream that is 121 everywhere but
    at ``pos`` (bytes ``vals`` <= 242): zeros (fresh calloc pages, free until touched) and the
    five values of each listed group written by five scatters. The float32 products are those
    of :func:`_unpack_scale_cpu` (``q * float32(scale)`` from the same three ``q``), bit for bit:
    a 121 group is five ``0 * scale = +0.0`` (scale is finite and >= 0)."""
    g = groups(numel)
    out = np.zeros(numel, dtype=np.float32)
    with np.errstate(over="ignore"):
        table = np.array([-1.0, 0.0, 1.0], dtype=np.float32) * np.float32(scale)
    rest = vals.copy()
    for k in range(4, -1, -1):
        digit = rest % 3
        rest //= 3
        at = pos + k * g
        inside = at < numel  # the padding digits of the last parts are dropped
        if not inside.all():
            at, digit = at[inside], digit[inside]
        out[at] = table[digit]
    return out


def zero_run_expanded_length(data: torch.Tensor) -> int:
    """How many bytes ``data`` expands to: ``v - 241`` for each byte ``v >= 243``, else 1."""
    extra = torch.clamp(data.reshape(-1), min=RUN_BASE - 1) - (RUN_BASE - 1)  # uint8, 0..13
    return data.numel() + int(extra.sum(dtype=torch.int64))


def zero_run_decode(data: torch.Tensor, expected_len: int, name: str = "") -> torch.Tensor:
    """Expand run bytes 243..255 back to runs of 121; the result has ``expected_len`` bytes.

    The expanded length is computed from ``data`` before anything of that size is allocated;
    a mismatch raises :class:`PayloadError` naming ``name``.
    """
    x = data.reshape(-1)
    total = zero_run_expanded_length(x)
    if total != expected_len:
        raise PayloadError(name, f"zero runs expand to {total} groups, expected {expected_len}")
    if total == x.numel():  # no run bytes
        return x.clone()
    is_run = x >= RUN_BASE
    counts = torch.where(is_run, x - (RUN_BASE - 2), 1).to(torch.uint8)
    idx_dtype = torch.int32 if total < 2**31 - 1 else torch.int64
    ends = torch.cumsum(counts, 0, dtype=idx_dtype)
    keep = ~is_run
    pos = (ends - counts)[keep]
    out = torch.full((total,), ZERO_GROUP, dtype=torch.uint8, device=x.device)
    out[pos] = x[keep]
    return out


def _run_bytes(length: int) -> bytes:
    """The zero-run coding of ``length`` consecutive 121 bytes (module docstring, step 3)."""
    full, r = divmod(length, MAX_RUN)
    return b"\xff" * full + (bytes([_LAST_PIECE_NP[r]]) if r else b"")


def _encode_split(
    kernel: Any, a: np.ndarray, s: float, buf: bytearray, rec: np.ndarray | None, zero_run: bool
) -> tuple[int, float, bytes]:
    """The C encoder over ranges on the CPU threads (:func:`fedcomp.codecs.sbc.split_run`):
    ``(code, m, data)`` as ``kernel.encode`` gives them. max|a| and the candidates for +-1 are
    taken per range of values; a sparse tensor (each range found at most one value in
    ``_SPARSE_ENCODE`` beyond its bound) is then packed from its candidates in one call.
    Otherwise each range of groups is packed into its own part of ``buf``; with zero runs, a range
    codes only from its first byte other than 121 to its last and returns the runs of 121 at
    its ends, which are joined here with the neighbours' (a run may span ranges), so the bytes
    are the single-threaded ones."""
    n = a.shape[0]
    g = groups(n)
    per = _SPARSE_ENCODE
    cand = np.empty(n // per + 1, dtype=np.int64)  # range [b, e) may write cand[b // per : e // per]
    scans = split_run(
        lambda b, e: (b // per, *kernel.scan(a, b, e, s, cand, b // per, e // per - b // per)),
        n,
        _SCAN_CHUNK,
        _PARALLEL_VALUES // 2,
    )
    code, m, tbits = kernel.params(max(top for _, top, _ in scans), s)
    if code:
        return code, math.nan if code == 1 else math.inf, b""
    if all(count >= 0 for _, _, count in scans):  # sparse: the bytes from the candidates alone
        pos = np.concatenate([cand[at : at + count] for at, _, count in scans])
        nbytes = kernel.pack_sparse(a, pos, tbits, m, buf, rec, zero_run)
        return 0, m, bytes(buf) if nbytes == g else bytes(memoryview(buf)[:nbytes])
    ranges = split_run(
        lambda g0, g1: (g0, *kernel.pack(a, tbits, m, g0, g1, buf, rec, zero_run, False)),
        g,
        _CPU_CHUNK,
        _PARALLEL_GROUPS,
    )
    if not zero_run:
        return 0, m, bytes(buf)
    view = memoryview(buf)
    pieces: list[bytes | memoryview] = []
    pending = 0  # 121s carried over from the ranges before
    for g0, lead, nbytes, trail in ranges:
        if nbytes == 0:  # all 121
            pending += lead
            continue
        pieces.append(_run_bytes(pending + lead))
        pieces.append(view[g0 : g0 + nbytes])
        pending = trail
    pieces.append(_run_bytes(pending))
    return 0, m, b"".join(pieces)


# --- the codec ------------------------------------------------------------------------------------


class ThreeLC(Codec):
    """3LC: 3-value quantization (sparsity multiplier ``s``), base-3^5 packing, zero-run encoding.

    ``s`` in [1, 2) trades accuracy for sparsity (larger: more zeros, shorter zero-run output);
    ``zero_run`` turns the final lossless step on (default) or off (exactly 1.6 bits per value).
    Stateless: error accumulation is :class:`fedcomp.methods.feedback.ErrorFeedback`'s job, fed by the
    reconstruction that encoding returns.
    """

    codec_id = "3lc"
    tensor_parallel = True  # no shared scratch; the kernels release the GIL
    version = 1
    s: float
    zero_run: bool

    def __init__(self, s: float = 1.0, zero_run: bool = True) -> None:
        s = check_number("s", s, low=1.0, high=2.0, low_open=False, high_open=True)
        if not isinstance(zero_run, bool):
            raise ConfigError(f"zero_run: must be true or false, got {zero_run!r}")
        self.s = s
        self.zero_run = zero_run

    def _params(self) -> dict[str, Any]:
        return {"s": self.s, "zero_run": self.zero_run}

    def encode(self, tensor: torch.Tensor, name: str = "") -> EncodedTensor:
        """:meth:`Codec.encode` without the float32 reconstruction (only error feedback needs it)."""
        check_wire_dtype(tensor, name)
        payload, _ = self._payload(self._flatten(tensor, name), name, want_recon=False)
        return self._envelope(tensor, name, payload)

    def _encode(self, flat: torch.Tensor, name: str) -> tuple[Payload, torch.Tensor | None]:
        return self._payload(flat, name, want_recon=True)

    def _payload(self, flat: torch.Tensor, name: str, want_recon: bool) -> tuple[ThreeLCPayload, torch.Tensor | None]:
        if flat.device.type == "cpu":
            return self._payload_cpu(flat.contiguous().numpy(), name, want_recon)
        n = flat.numel()
        m = scale_for(max_abs(flat, name), self.s)
        recon: torch.Tensor | None = None
        if m == 0.0:
            packed = _zero_packed(n, flat.device)
            if want_recon:
                recon = torch.zeros(n, dtype=torch.float32, device=flat.device)
        else:
            packed, recon = _quantize_pack(flat, m)
        if self.zero_run:
            packed = zero_run_encode(packed)
        data = packed.cpu().numpy().tobytes()
        return ThreeLCPayload(scale=m, numel=n, zero_run=self.zero_run, data=data), recon

    def _payload_cpu(self, a: np.ndarray, name: str, want_recon: bool) -> tuple[ThreeLCPayload, torch.Tensor | None]:
        """:meth:`_payload` on CPU, all in NumPy. One read of ``a`` finds ``max|a|`` and the
        candidates for +-1 (:func:`_scan_cpu`); a sparse tensor (the usual model delta) is then
        packed from those alone and zero-run coded from the groups that are not 121. A dense
        one (more than one value in ``_SPARSE_ENCODE`` beyond the bound) takes a second read,
        the fused quantize + pack; both split among the CPU threads."""
        if _KERNEL is not None:
            done = self._payload_native(_KERNEL, a, name, want_recon)
            if done is not None:
                return done
        n = a.shape[0]
        top, cand = _scan_cpu(a, self.s, n // _SPARSE_ENCODE) if n else (0.0, None)
        if not math.isfinite(top):
            raise ValueError(f"tensor {name!r}: 3LC cannot encode non-finite values (max|T| = {top})")
        m = scale_for(top, self.s)
        t = round_threshold(m) if m > 0.0 else None
        recon: torch.Tensor | None = None
        g = groups(n)
        if t is not None and cand is not None:
            at, byte = _pack_sparse_cpu(a, cand, t)
            if want_recon:  # fresh zeros (+0.0, as 0 * m), +-m at the values beyond t
                rec = np.zeros(n, dtype=np.float32)
                _fill_sparse_recon(a, t, m, at, g, rec)
                recon = torch.from_numpy(rec)
            if self.zero_run:
                data = _zero_run_from_literals(at, byte, g).tobytes()
            else:
                full = np.full(g, ZERO_GROUP, dtype=np.uint8)
                full[at] = byte
                data = full.tobytes()
            return ThreeLCPayload(scale=m, numel=n, zero_run=self.zero_run, data=data), recon
        if m == 0.0:
            packed = _zero_packed(n, torch.device("cpu")).numpy()
            if want_recon:
                recon = torch.zeros(n, dtype=torch.float32)
        elif t is not None:
            if want_recon:
                recon = torch.empty(n, dtype=torch.float32)
            packed = _quantize_pack_cpu(a, t, m, None if recon is None else recon.numpy())
        else:  # a subnormal scale without a threshold: the division path
            packed_t, recon = _quantize_pack(torch.from_numpy(a), m)
            packed = packed_t.numpy()
        if self.zero_run:
            packed = _zero_run_encode_np(packed)
        return ThreeLCPayload(scale=m, numel=n, zero_run=self.zero_run, data=packed.tobytes()), recon

    def _payload_native(
        self, kernel: Any, a: np.ndarray, name: str, want_recon: bool
    ) -> tuple[ThreeLCPayload, torch.Tensor | None] | None:
        """:meth:`_payload_cpu` by the C kernels (module docstring): max|a| and the candidates
        for +-1 in one read, then the packed, zero-run coded bytes straight into a buffer of
        ``ceil(n / 5)`` bytes (the coded stream is never longer), the reconstruction written
        only where ``q != 0`` into fresh zeros. A large tensor is split into ranges on the CPU
        threads (:func:`_encode_split`). None for a subnormal scale without a threshold (the
        NumPy path then divides)."""
        n = a.shape[0]
        g = groups(n)
        buf = bytearray(g)
        rec = np.zeros(n, dtype=np.float32) if want_recon else None  # calloc: untouched pages stay free
        if n >= _PARALLEL_VALUES and torch.get_num_threads() > 1:
            code, m, data = _encode_split(kernel, a, self.s, buf, rec, self.zero_run)
        else:
            cand = np.empty(n // _SPARSE_ENCODE, dtype=np.int64)
            code, m, nbytes = kernel.encode(a, self.s, buf, rec, self.zero_run, cand)
            data = bytes(buf) if nbytes == g else bytes(memoryview(buf)[:nbytes])
        if code in (1, 2):  # NaN, or an infinity: m is max|a|
            raise ValueError(f"tensor {name!r}: 3LC cannot encode non-finite values (max|T| = {m})")
        if code:
            return None
        recon = None if rec is None else torch.from_numpy(rec)
        return ThreeLCPayload(scale=m, numel=n, zero_run=self.zero_run, data=data), recon

    def _checked(self, payload: Payload, spec: TensorSpec) -> tuple[bytes | bytearray, float]:
        """``(data, scale)`` of a 3LC payload after the checks that need no decoding (types,
        ``numel``, a finite scale >= 0 and not -0.0, the length of ``data``); raise
        :class:`PayloadError`."""
        name = spec.name
        expect_payload(payload, ThreeLCPayload, name)
        assert isinstance(payload, ThreeLCPayload)
        numel = spec.numel
        if isinstance(payload.numel, bool) or not isinstance(payload.numel, int) or payload.numel != numel:
            raise PayloadError(name, f"payload has {payload.numel!r} values, expected {numel}")
        scale = payload.scale
        if (
            (type(scale) is not float and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)))
            or not math.isfinite(scale)
            or scale < 0
        ):  # (a float first: numbers.Real's isinstance is slow)
            raise PayloadError(name, f"scale {scale!r} is not a finite number >= 0")
        if scale == 0 and math.copysign(1.0, scale) < 0:  # (no encoder sends it; FORMAT.md)
            raise PayloadError(name, "scale -0.0 is not +0.0, the zero scale")
        data = payload.data
        if not isinstance(data, (bytes, bytearray)) or not isinstance(payload.zero_run, bool):
            raise PayloadError(name, "malformed 3LC payload (data must be bytes, zero_run a bool)")
        g = groups(numel)
        if not payload.zero_run and len(data) != g:
            raise PayloadError(name, f"data is {len(data)} bytes, expected {g}")
        if len(data) > g:  # a zero-run stream is never longer than its expansion
            raise PayloadError(name, f"data is {len(data)} bytes, more than the {g} groups it codes")
        return data, float(scale)

    def checked_stream(self, payload: Payload, spec: TensorSpec) -> tuple[bytes | bytearray, float]:
        """``(data, scale)`` of a 3LC payload after every check of :meth:`literals` that needs no
        decoding (the envelope's aside): what a caller hands a kernel that reads the stream itself
        (:class:`fedcomp.codecs.threelc_device.StreamBatch`). ``len(data)`` is at most the
        tensor's groups."""
        return self._checked(payload, spec)

    def literals(self, payload: Payload, spec: TensorSpec) -> tuple[np.ndarray, np.ndarray, float]:
        """The decoder without its dense output: after every check of :meth:`decode` but the
        envelope's, the groups other than 121 (their indices, ascending, and their bytes, all
        <= 242) and the scale; every other group decodes to five zeros. What the whole-update
        engine (:mod:`fedcomp.codecs.threelc_device`) unpacks on a device."""
        data, scale = self._checked(payload, spec)
        raw = np.frombuffer(data, dtype=np.uint8)
        assert isinstance(payload, ThreeLCPayload)
        if payload.zero_run:
            pos, vals = _literals_np(raw, groups(spec.numel), spec.name)
            return pos, vals, scale
        top = int(raw.max()) if raw.shape[0] else 0
        if top >= RUN_BASE:
            raise PayloadError(spec.name, f"byte {top} is not a base-3^5 code (0..242) without zero runs")
        pos = np.flatnonzero(raw != ZERO_GROUP)
        return pos, raw[pos], scale

    def _decode(self, payload: Payload, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        name = spec.name
        data, scale = self._checked(payload, spec)
        assert isinstance(payload, ThreeLCPayload)
        numel = spec.numel
        g = groups(numel)
        if g == 0:
            return torch.zeros(0, dtype=torch.float32, device=device)
        if device.type == "cpu":
            # the C decoder, when the stream's length is right (else the NumPy one raises), into
            # fresh zeros: only the groups other than 121 are written
            if _KERNEL is not None and (not payload.zero_run or _KERNEL.expanded_length(data) == g):
                out = np.zeros(numel, dtype=np.float32)
                if _KERNEL.decode(data, numel, float(scale), payload.zero_run, out, True):
                    return torch.from_numpy(out)
            return torch.from_numpy(
                self._decode_cpu(np.frombuffer(data, dtype=np.uint8), payload.zero_run, numel, name, float(scale))
            )
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        if payload.zero_run:
            packed = zero_run_decode(raw, g, name)
        else:
            top = int(raw.max())
            if top >= RUN_BASE:
                raise PayloadError(name, f"byte {top} is not a base-3^5 code (0..242) without zero runs")
            packed = raw
        return _unpack_scale(packed, numel, float(scale), device)

    def _decode_into(self, payload: Payload, spec: TensorSpec, out: torch.Tensor) -> None:
        # The C decoder writes every value (zero groups too) into the warm buffer when the
        # payload passes its checks; anything else goes the checked way (:meth:`_decode`).
        if (
            _KERNEL is not None
            and out.device.type == "cpu"
            and out.dtype == torch.float32
            and isinstance(payload, ThreeLCPayload)
            and type(payload.numel) is int
            and payload.numel == spec.numel > 0
            and isinstance(payload.scale, float | int)
            and not isinstance(payload.scale, bool)
            and math.isfinite(payload.scale)
            and payload.scale >= 0
            and isinstance(payload.data, bytes | bytearray)
            and type(payload.zero_run) is bool
        ):
            data, g = payload.data, groups(spec.numel)
            fits = len(data) == g if not payload.zero_run else len(data) <= g and _KERNEL.expanded_length(data) == g
            if fits and _KERNEL.decode(data, spec.numel, float(payload.scale), payload.zero_run, out.numpy(), False):
                return
        super()._decode_into(payload, spec, out)

    @staticmethod
    def _decode_cpu(raw: np.ndarray, zero_run: bool, numel: int, name: str, scale: float) -> np.ndarray:
        """:meth:`_decode` on CPU (lengths checked), all in NumPy. A sparse update (few groups
        other than 121, the common case) is decoded from its literal bytes alone, without
        expanding the zero runs; a dense one is expanded and unpacked by :func:`_unpack_scale_cpu`."""
        g = groups(numel)
        if zero_run:
            pos, vals = _literals_np(raw, g, name)
        else:
            top = int(raw.max())
            if top >= RUN_BASE:
                raise PayloadError(name, f"byte {top} is not a base-3^5 code (0..242) without zero runs")
            pos = np.flatnonzero(raw != ZERO_GROUP)
            vals = raw[pos]
        with np.errstate(over="ignore"):
            finite = bool(np.isfinite(np.float32(scale)))  # else 0 * scale is NaN: every group counts
        if finite and pos.shape[0] * _SPARSE_DECODE <= g:
            return _sparse_unpack_scale_np(pos, vals, numel, scale)
        if zero_run:
            packed = np.full(g, ZERO_GROUP, dtype=np.uint8)
            packed[pos] = vals
        else:
            packed = raw
        out = np.empty(numel, dtype=np.float32)
        _unpack_scale_cpu(packed, scale, out)
        return out
