"""Sparse Binary Compression (Sattler, Wiedemann, Müller, Samek 2018): the uplink codec.

Algorithm 2 of the paper, per tensor: take the ``k = max(1, round(p * n))`` largest entries (the
positive side) and the ``k`` smallest (the negative side); ``mu+`` is the mean of the positive
selection, ``mu-`` the mean of the absolute values of the negative selection. If ``mu+ >= mu-``
only the positive selection is kept, every entry set to ``mu+``; otherwise only the negative
selection, every entry set to ``-mu-``. The message is that one signed mean plus the positions,
Golomb-Rice coded (:mod:`fedcomp.codecs.golomb`, Algorithm 3 in a two-section layout).

**Departure: a side whose mean is +0.0 is sent as no positions.** Where the side kept has mean
+0.0 (every kept value zero: a frozen layer's update, a tensor the round did not touch; or a sum
so small that its mean rounds to zero), the paper still sends its ``k`` positions, each set to
zero: nothing a receiver decodes. fedcomp sends ``nnz = 0`` (``golomb_b = 0``, no bits, mean
0.0) instead, which decodes to the same tensor, bit for bit (all +0.0), and leaves the same
residual; a decoder accepts either. (A mean of -0.0, a negative sum that rounds to zero, keeps
its positions: there the decoded zeros are negative.)

Determinism: the bytes depend on the values only, never on the device, the thread count or the
reduction order. Ties at the selection boundary go to the lowest indices; the means are exact
(float64 sums where that is provably exact, else integer sums per float32 exponent), rounded
once to the nearest float32 (ties to even); the two sides are compared exactly. CPU and CUDA
give identical bytes.

What runs where:

- **CPU with the C kernels** (``fedcomp._native._sbc``, built by ``setup.py``; see
  :mod:`fedcomp._native`): fast mode's sample gather and both sample thresholds in one call,
  the threshold scan in one pass per part of :func:`split_run` (SSE2, or AVX2 where the CPU has
  it), exact mode's order statistics for tensors of up to ``_KERNEL_ORDER_MAX`` values, the
  float64 sums of the means, Golomb coding and decoding (:mod:`fedcomp.codecs.golomb`) and the
  decoder's dense output (zeros and the mean written in one pass). All release the GIL. A
  whole update's tensors go to the kernel in one call (:meth:`SBC.encode_many`, what
  :class:`fedcomp.methods.update.UpdateEncoder` uses without error feedback): every step of every
  tensor there, on the threads of torch's OpenMP team, with no Python between the steps.
- **CPU without them** (not built, or ``FEDCOMP_NATIVE=0``): the same steps in NumPy (its
  compare and nonzero are several times faster than torch's on CPU; torch's CPU kernels run
  OpenMP regions that slow down many-fold when the machine is busy, NumPy's run on the calling
  thread or on :func:`split_run`'s). Both CPU paths give the same bytes, tested.
- **Other devices** (CUDA), one tensor: the selection in torch; the selected values come back
  to the host for the means, as on CPU. A whole update on such a device goes through
  :mod:`fedcomp.codecs.sbc_device` instead (what :class:`fedcomp.methods.update.UpdateEncoder`
  runs there): every step once for all tensors, the same bytes.
"""

from __future__ import annotations

import ctypes
import math
import os
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeVar

import numpy as np
import torch

from fedcomp import _native
from fedcomp.codecs.base import Codec, TensorSpec, check_wire_dtype, expect_payload
from fedcomp.codecs.golomb import LN_PHI_MINUS_1, check_stream, decode_positions, encode_positions, golomb_b
from fedcomp.errors import ConfigError, PayloadError, check_number
from fedcomp.wire.payloads import EncodedTensor, Payload, SBCPayload, filled

MODES = ("exact", "fast")

#: The C kernels (:mod:`fedcomp._native`), or None: then the CPU paths run in NumPy.
_KERNEL = _native.load("sbc")
#: The process that loaded them: a forked child must not hand work to the OpenMP team (team.h).
_KERNEL_PID = os.getpid()

#: Elements per chunk for the CPU threshold pass (the chunk and its mask stay in cache).
_CPU_CHUNK = 1 << 16

#: The CPU threshold pass uses up to torch.get_num_threads() threads (at most _MAX_WORKERS), one
#: per _PARALLEL_MIN elements.
_PARALLEL_MIN = 1 << 19
_MAX_WORKERS = 8

#: What SBC sends for a tensor whose kept side's mean is +0.0: no positions (the module doc).
NOTHING_KEPT = SBCPayload(mean=0.0, golomb_b=0, nnz=0, bits=b"")


def keeps_nothing(mean: float) -> bool:
    """Whether a kept side of mean ``mean`` is sent as :data:`NOTHING_KEPT`: its mean is +0.0."""
    return mean == 0.0 and math.copysign(1.0, mean) > 0


def side_payload(mean: float, golomb_b: int, nnz: int, bits: bytes) -> SBCPayload:
    """The payload of a kept side: :data:`NOTHING_KEPT` where its mean is +0.0 (the module doc).
    Made by :func:`~fedcomp.wire.payloads.filled` (what ``SBCPayload(...)`` makes, in half its
    time: one a tensor every round)."""
    if mean == 0.0 and keeps_nothing(mean):
        return NOTHING_KEPT
    return filled(SBCPayload, {"mean": mean, "golomb_b": golomb_b, "nnz": nnz, "bits": bits})


#: Seed of the fast mode's sample positions (part of the wire format: changing it changes bytes).
_SAMPLE_SEED = 0x5BC_2018


def default_sample_size(p: float) -> int:
    """Sample size for fast mode: the sample's own top fraction ``p`` has about 256 entries."""
    return math.ceil(256.0 / p)


def check_selection_params(p: float, mode: str, sample_size: int | None, p_max: float) -> tuple[float, str, int]:
    """Validated ``(p, mode, sample_size)`` of a codec that keeps a fraction ``p`` of a tensor by
    magnitude, exactly or from a sampled threshold (SBC, STC); raise :class:`ConfigError`."""
    p = check_number("p", p, low=0.0, high=p_max)
    if mode not in MODES:
        raise ConfigError(f"mode: must be one of {list(MODES)}, got {mode!r}")
    if sample_size is None:
        sample_size = default_sample_size(float(p))
    if isinstance(sample_size, bool) or not isinstance(sample_size, int) or sample_size < 1:
        raise ConfigError(f"sample_size: must be a positive integer, got {sample_size!r}")
    return float(p), mode, int(sample_size)


class SBC(Codec):
    """Sparse Binary Compression of one tensor (fraction ``p`` per side; Algorithm 2).

    ``mode="exact"`` selects exactly ``k = max(1, round(p * n))`` entries per side, ties broken
    towards the lowest index: the paper's algorithm, bit for bit (tests compare it with a plain
    Python reference). On CPU it costs two reads of a large tensor (a finiteness check, then a
    threaded scan for candidates beyond bounds read off a subsample; the selection works on
    those); elsewhere a top-k per side.

    ``mode="fast"`` (the default) follows the paper's suggestion to subsample: it estimates the
    two thresholds from a deterministic sample of ``sample_size`` entries (stratified positions
    with hashed jitter, the same on every device), then keeps ``x >= thr_hi`` and
    ``x <= thr_lo`` in one cache-blocked pass over the tensor (multi-threaded on CPU). The
    means, the side decision and the coding are those of exact mode. Subsampling makes the
    number kept stray from ``k``. Measured on student-t (df 3) and Gaussian tensors of 2**20
    elements, 40 seeds each, with the default ``sample_size = ceil(256 / p)`` (about 256 sampled
    entries above each threshold, so roughly ``1 / sqrt(256)`` = 6 % noise per side): the
    typical deviation is 3 to 5 % of ``k`` (mean |nnz - k| / k 3.6 to 4.8 % at p = 0.01 and
    0.001), the largest 10 to 16 %; the kept count is 1.5 to 4 % below ``k`` on average, because
    the side with the higher threshold (fewer entries) tends to have the larger mean and win.
    A side that selects nothing or more than ``2 k`` entries (ties, masses of zeros) and any
    tensor of at most ``sample_size`` elements fall back to exact mode.

    Inputs must be finite: exact mode raises :class:`ValueError` on any NaN or infinity; fast
    mode raises on infinities and on sampled NaNs, but a NaN that is neither sampled nor selected
    goes unnoticed (comparisons never select it).

    :meth:`encode` skips the dense reconstruction; :meth:`encode_with_reconstruction` (what
    error feedback calls) builds it as zeros plus the kept positions set to the mean.
    """

    codec_id = "sbc"
    version = 1
    tensor_parallel = True  # per-thread scratch (_scratch); the kernels release the GIL

    def __init__(self, p: float = 0.01, mode: str = "fast", sample_size: int | None = None) -> None:
        self.p, self.mode, self.sample_size = check_selection_params(p, mode, sample_size, p_max=0.5)

    def _params(self) -> dict[str, Any]:
        return {"p": self.p, "mode": self.mode, "sample_size": self.sample_size}

    # --- encoding -----------------------------------------------------------------------------

    def encode(self, tensor: torch.Tensor, name: str = "") -> EncodedTensor:
        """Compress ``tensor``: :meth:`Codec.encode` without building the dense reconstruction
        (a full-size tensor that only error feedback needs; it would cost as much as a clone)."""
        check_wire_dtype(tensor, name)
        payload, _ = self._payload(self._flatten(tensor, name), name)
        return self._envelope(tensor, name, payload)

    def encode_many(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[EncodedTensor | None]:
        """:meth:`encode` of each ``(name, tensor)``: the same bytes (tested), the whole list in one
        call of the C kernel (``encode_many``: selection, sums, side and Golomb code per tensor, on
        ``torch.get_num_threads()`` threads) instead of a dozen Python-driven steps per tensor.

        An entry is None where the tensor is left to :meth:`encode`, which the caller then calls,
        so its errors are :meth:`encode`'s: no kernel, not a contiguous float32 CPU tensor, fewer
        than two elements, or a case only the Python path handles (a value not finite, exact mode
        above ``_KERNEL_ORDER_MAX`` elements, sums whose exponents span too far for float64). A
        tensor larger than an even share of the list is left too: in the list it would keep one
        thread busy while the others wait, where :meth:`encode` splits its scan over them."""
        out: list[EncodedTensor | None] = [None] * len(tensors)
        kernel = _KERNEL
        if kernel is None or not hasattr(kernel, "encode_many"):
            return out
        threads, use_team = team_threads()
        share = sum(t.numel() for _, t in tensors) // threads
        tasks: list[tuple[int, int, tuple[np.ndarray, np.ndarray | None, int, int]]] = []
        p, s, fast_mode = self.p, self.sample_size, self.mode == "fast"
        r = max(1, round(p * s))
        for i, (_, t) in enumerate(tensors):
            n = t.numel()
            if n < 2 or not t.is_cpu or t.dtype != torch.float32 or not t.is_contiguous():
                continue
            if threads > 1 and n > share:
                continue
            fast = fast_mode and n > s
            if not fast and n > _KERNEL_ORDER_MAX:
                continue
            where = _sample_positions_np(n, s) if fast else None
            tasks.append((n, i, (t.detach().numpy(), where, max(1, round(p * n)), r)))
        if not tasks:
            return out
        tasks.sort(key=lambda task: -task[0])  # largest first: the threads end together
        found = kernel.encode_many([task[2] for task in tasks], _KERNEL_ORDER_MAX, LN_PHI_MINUS_1, threads, use_team)
        for (n, i, _), res in zip(tasks, found, strict=True):
            if res is None:
                continue
            total, nnz, b, bits = res
            mean = _kernel_mean(total, nnz, b, n)
            if mean is None:
                continue
            name, t = tensors[i]
            out[i] = self._envelope(t, name, side_payload(mean, b, nnz, bits))
        return out

    def encode_sparse(self, tensor: torch.Tensor, name: str = "") -> tuple[EncodedTensor, np.ndarray, float] | None:
        """:meth:`encode`, with what the receiver will decode said sparsely: the kept positions
        (ascending int64, into the flattened tensor) and the one float32 value there (zeros
        elsewhere). For error feedback, which then takes that value off its residual at those
        positions instead of subtracting a dense reconstruction. None off CPU."""
        if tensor.device.type != "cpu":
            return None
        check_wire_dtype(tensor, name)
        payload, idx = self._payload(self._flatten(tensor, name), name)
        return self._envelope(tensor, name, payload), idx.numpy(), payload.mean

    def _encode(self, flat: torch.Tensor, name: str) -> tuple[Payload, torch.Tensor | None]:
        payload, idx = self._payload(flat, name)
        if flat.device.type == "cpu":  # as in the decoder
            return payload, torch.from_numpy(_dense_cpu(idx.numpy(), flat.numel(), payload.mean))
        recon = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        return payload, recon.index_fill_(0, idx, payload.mean)

    def _payload(self, flat: torch.Tensor, name: str) -> tuple[SBCPayload, torch.Tensor]:
        """The payload and the kept positions (ascending, on ``flat``'s device)."""
        n = flat.numel()
        none = torch.zeros(0, dtype=torch.int64, device=flat.device)
        if n == 0:
            return NOTHING_KEPT, none
        k = max(1, round(self.p * n))
        chosen = None
        if self.mode == "fast" and n > self.sample_size:
            chosen = self._fast_select(flat, k)
            if chosen is None and flat.device.type == "cpu" and not flat.numpy().any():
                return NOTHING_KEPT, none  # all zeros (a frozen layer): what exact mode ends with
        if chosen is None:
            chosen = _exact_select(flat, k, name)
        idx, mean = chosen
        if keeps_nothing(mean):
            return NOTHING_KEPT, none
        nnz = idx.numel()
        b = golomb_b(nnz / n)
        return SBCPayload(mean=mean, golomb_b=b, nnz=nnz, bits=encode_positions(idx, b)), idx

    def _fast_select(self, flat: torch.Tensor, k: int) -> tuple[torch.Tensor, float] | None:
        """Threshold selection, or None to fall back to exact mode."""
        n, s = flat.numel(), self.sample_size
        where = _sample_positions(n, s, str(flat.device))
        on_cpu = flat.device.type == "cpu"
        r = max(1, round(self.p * s))
        kernel = _KERNEL
        if on_cpu and kernel is not None and _split_parts(n) == 1:
            return _fast_select_native(kernel, flat, where, r, k)
        if on_cpu and kernel is not None:  # gather and both order statistics in one call
            thresholds = kernel.sample_thresholds(flat.numpy(), where.numpy(), r, _scratch("f32", 2 * s, np.float32))
            if thresholds is None:
                return None  # a NaN or infinity: exact mode reports it
            thr_lo, thr_hi = np.float32(thresholds[0]), np.float32(thresholds[1])
        else:
            sample = flat.numpy()[where.numpy()] if on_cpu else flat.index_select(0, where).cpu().numpy()
            if not np.isfinite(sample).all():
                return None
            thr_lo, thr_hi = _order_stats(sample, r)
        found: tuple[Positions, np.ndarray, Positions, np.ndarray] | None
        if flat.device.type == "cpu":
            found = _threshold_select_cpu(flat.numpy(), thr_hi, thr_lo, limit=4 * k)
        else:
            found = _threshold_select_torch(flat, thr_hi, thr_lo, limit=4 * k)
        if found is None:
            return None
        hi, hi_vals, lo, lo_vals = found
        if not (0 < len(hi) <= 2 * k and 0 < len(lo) <= 2 * k):
            return None
        return _choose(flat, hi, hi_vals, lo, lo_vals)

    # --- decoding -----------------------------------------------------------------------------

    def _decode(self, payload: Payload, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        numel = spec.numel
        idx, mean32 = self.positions(payload, spec, device)
        if device.type == "cpu":
            return torch.from_numpy(_dense_cpu(idx.numpy(), numel, mean32))
        out = torch.zeros(numel, dtype=torch.float32, device=device)
        if idx.numel():
            out.index_fill_(0, idx, mean32)
        return out

    def _decode_into(self, payload: Payload, spec: TensorSpec, out: torch.Tensor) -> None:
        if out.device.type != "cpu" or out.dtype != torch.float32:
            return super()._decode_into(payload, spec, out)
        idx, mean32 = self.positions(payload, spec, out.device)
        _fill_cpu(out.numpy(), idx.numpy(), mean32, stream=True)  # the warm buffer written once

    def positions(self, payload: Payload, spec: TensorSpec, device: torch.device) -> tuple[torch.Tensor, float]:
        """The decoder without its dense output: the kept positions (ascending, on ``device``) and
        the one float32 value they share, after every payload check of :meth:`decode` but the
        envelope's (a server summing replies scatter-adds these instead of materialising)."""
        nnz, b, bits, mean32 = self._checked(payload, spec)
        return decode_positions(bits, nnz, b, spec.numel, spec.name, device), mean32

    def checked_positions(self, payload: Payload, spec: TensorSpec) -> tuple[int, int, bytes, float]:
        """``(nnz, golomb_b, bits, value)`` of an SBC payload after every check of
        :meth:`positions` that needs no decoding (the envelope's aside): what a caller hands a
        kernel that decodes the stream itself (the server's running sum,
        :mod:`fedcomp.flower.weighted_sum`)."""
        nnz, b, bits, mean32 = self._checked(payload, spec)
        check_stream(bits, nnz, b, spec.numel, spec.name)
        return nnz, b, bits, mean32

    def _checked(self, payload: Payload, spec: TensorSpec) -> tuple[int, int, bytes, float]:
        """``(nnz, golomb_b, bits, mean32)`` of an SBC payload after the checks that need no
        decoding (types, ``nnz``, a finite float32 mean); raise :class:`PayloadError`."""
        name = spec.name
        expect_payload(payload, SBCPayload, name)
        assert isinstance(payload, SBCPayload)
        numel = spec.numel
        nnz, b, mean, bits = payload.nnz, payload.golomb_b, payload.mean, payload.bits
        if not (
            isinstance(nnz, int)
            and isinstance(b, int)
            and isinstance(mean, (int, float))
            and isinstance(bits, (bytes, bytearray))
        ):
            raise PayloadError(name, "SBC payload fields have the wrong types")
        mean = float(mean)
        if nnz > numel:
            raise PayloadError(name, f"nnz {nnz} exceeds the tensor's {numel} elements")
        try:  # float32 rounding; packing raises OverflowError past float32's range
            mean32 = struct.unpack("<f", struct.pack("<f", mean))[0] if math.isfinite(mean) else mean
        except OverflowError:
            mean32 = math.inf
        if not math.isfinite(mean32):
            raise PayloadError(name, f"mean {mean!r} is not a finite float32")
        return nnz, b, bits, float(mean32)


def _dense_cpu(idx: np.ndarray, numel: int, value: float) -> np.ndarray:
    """A float32 array of ``numel`` zeros but ``value`` at the ascending positions ``idx``.

    NumPy: zeros from calloc (fresh zero pages that cost nothing until touched; torch.zeros
    writes every page) and NumPy's scatter (torch's CPU index_fill_ is many-fold slower on a
    busy machine). The C kernel: uninitialised memory written once, zeros and values in one
    pass, on the calling thread (measured on the whole update: splitting it among threads is
    slower, their page faults contend). ``value`` is a float32 value, stored exactly either way.
    """
    if _KERNEL is None:
        arr = np.zeros(numel, dtype=np.float32)
        arr[idx] = value
        return arr
    arr = np.empty(numel, dtype=np.float32)
    _fill_cpu(arr, idx, value)
    return arr


def _fill_cpu(arr: np.ndarray, idx: np.ndarray, value: float, stream: bool = False) -> None:
    """Overwrite float32 ``arr`` with zeros but ``value`` at the ascending positions ``idx``
    (one pass with the C kernel; NumPy's zero fill and scatter without it). ``stream``: ``arr`` is a
    buffer the receiver keeps (its pages mapped), so the kernel may write a long one by
    non-temporal stores (not into fresh pages: slower there)."""
    if _KERNEL is None:
        arr[:] = 0.0
        arr[idx] = value
    else:
        _KERNEL.fill(arr, 0, arr.shape[0], np.ascontiguousarray(idx, dtype=np.int64), 0, idx.shape[0], value, stream)


# --- selection ------------------------------------------------------------------------------
#
# Positions are NumPy arrays on CPU and torch tensors elsewhere; values always come back to the
# host as NumPy float32 arrays, so the means (and the side decision) are computed by the same code
# for every device.

Positions = np.ndarray | torch.Tensor


def _exact_select(flat: torch.Tensor, k: int, name: str) -> tuple[torch.Tensor, float]:
    if flat.device.type == "cpu":
        a = flat.numpy()
        n = a.shape[0]
        kernel = _KERNEL
        if kernel is not None and 1 < n <= _KERNEL_ORDER_MAX and a.dtype == np.float32 and a.flags.c_contiguous:
            # A small tensor in three kernel calls: both thresholds (and the finiteness check),
            # then a scan at them for the candidates, of which the rule below keeps k per side.
            found = kernel.order_stats(a, k, _scratch("f32", n, np.float32))
            if found is None:
                raise ValueError(f"tensor {name!r}: SBC cannot encode NaN or infinite values")
            t_lo, t_hi = np.float32(found[0]), np.float32(found[1])
            sel = _scan_values_native(a, 0, n, t_hi, t_lo, 2 * n)
            assert sel is not None  # 2 n is more than both sides can hold
            cand_hi, hi_vals, cand_lo, lo_vals = sel
            keep_hi, keep_lo = _keep_extremes(hi_vals, t_hi, k, True), _keep_extremes(lo_vals, t_lo, k, False)
            chosen = _choose(flat, cand_hi[keep_hi], hi_vals[keep_hi], cand_lo[keep_lo], lo_vals[keep_lo])
        else:
            if not all_finite(a):
                raise ValueError(f"tensor {name!r}: SBC cannot encode NaN or infinite values")
            hi_np, lo_np = _extreme_positions_cpu(a, k)
            chosen = _choose(flat, hi_np, a[hi_np], lo_np, a[lo_np])
    else:
        if not bool(torch.isfinite(flat).all()):
            raise ValueError(f"tensor {name!r}: SBC cannot encode NaN or infinite values")
        hi = _extreme_positions_torch(flat, k, largest=True)
        lo = _extreme_positions_torch(flat, k, largest=False)
        chosen = _choose(flat, hi, flat[hi].cpu().numpy(), lo, flat[lo].cpu().numpy())
    assert chosen is not None  # every value is finite
    return chosen


def all_finite(a: np.ndarray) -> bool:
    """Whether every value of float ``a`` is finite: the min and max of each cache-sized chunk
    (NaN propagates through both), one read of ``a`` and no temporary of its size, split
    among the CPU threads."""

    def finite(begin: int, end: int) -> bool:
        with np.errstate(over="ignore", invalid="ignore"):  # set in the thread that sums
            for c0 in range(begin, end, _CPU_CHUNK):
                c = a[c0 : min(end, c0 + _CPU_CHUNK)]
                # One reduction: a NaN or infinity makes the sum non-finite; so can an overflow
                # of finite values, which the exact check then clears.
                if not math.isfinite(c.sum()) and not np.isfinite(c).all():
                    return False
        return True

    return a.shape[0] == 0 or all(split_run(finite, a.shape[0], _CPU_CHUNK))


def _extreme_positions_cpu(a: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Ascending positions of the ``k`` largest and of the ``k`` smallest entries of finite
    ``a``, ties going to the lowest index.

    For a large ``a`` and a small ``k`` (where :func:`_order_stats` would take the tails) the
    candidates are gathered in one threaded scan (:func:`_threshold_select_cpu` at bounds read
    off a subsample) and everything else works on them: both thresholds and both selections
    are those of the whole-array rule below, found without further passes over ``a``. Where a
    mass of equal values sits at a bound (a frozen layer's zeros, values on a coarse grid), the
    values strictly beyond the bounds and the first of those at them are taken instead
    (:func:`_extremes_at_ties`): the same selection, without sorting the whole array.
    """
    n = a.shape[0]
    if k >= n:  # only for n == 1
        everything = np.arange(n)
        return everything, everything
    if n >= _ORDER_MIN and k * _ORDER_STEP <= n:
        q_lo, q_hi = _tail_bounds(a, k)
        # About 4 k candidates are expected; masses of ties (zeros) make many more.
        limit = 16 * k + 64
        found = _threshold_select_cpu(a, q_hi, q_lo, limit=limit)
        if found is not None and found[0].shape[0] >= k and found[2].shape[0] >= k:
            hi, hi_vals, lo, lo_vals = found
            # Every entry at or beyond the k-th most extreme value is a candidate (that value is
            # at or beyond the bound), so the rule below, applied to the candidates, is exact.
            return _take_kth(hi, hi_vals, k, True), _take_kth(lo, lo_vals, k, False)
        if found is None:
            tied = _extremes_at_ties(a, k, q_lo, q_hi, limit)
            if tied is not None:
                return tied
    t_lo, t_hi = _order_stats(a, k)
    out = []
    for beyond, t in ((a > t_hi, t_hi), (a < t_lo, t_lo)):
        strict = np.flatnonzero(beyond)
        at = np.flatnonzero(a == t)[: k - strict.size]
        out.append(np.sort(np.concatenate([strict, at])) if at.size else strict)
    return out[0], out[1]


def _take_kth(pos: np.ndarray, vals: np.ndarray, k: int, largest: bool) -> np.ndarray:
    """Of candidates ``pos`` (ascending) holding ``vals``, at least ``k`` of them and among them
    every entry at or beyond the ``k``-th most extreme: the ``k`` kept by the whole-array rule of
    :func:`_extreme_positions_cpu`."""
    m = vals.shape[0]
    t = np.partition(vals, m - k)[m - k] if largest else np.partition(vals, k - 1)[k - 1]
    return _take_extremes(pos, vals, t, k, largest)


def _extremes_at_ties(
    a: np.ndarray, k: int, q_lo: np.float32, q_hi: np.float32, limit: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`_extreme_positions_cpu` where the scan at the bounds ``q_lo <= q_hi`` found too many
    candidates: the values strictly beyond each bound, in one scan (None past ``limit``). A side
    with at least ``k`` of them keeps its ``k`` most extreme as before; with ``g < k``, the
    ``k``-th most extreme value is the bound itself whenever at least ``k - g`` values equal it,
    and the rule keeps the ``g`` and the first ``k - g`` of those, found by a scan from the start
    that stops there (a frozen layer's zeros: the first chunk). None where a side has fewer: the
    caller then orders the whole array."""
    beyond = _threshold_select_cpu(
        a, np.nextafter(q_hi, np.float32(np.inf)), np.nextafter(q_lo, np.float32(-np.inf)), limit
    )
    if beyond is None:
        return None
    hi, hi_vals, lo, lo_vals = beyond
    out = []
    for pos, vals, q, largest in ((hi, hi_vals, q_hi, True), (lo, lo_vals, q_lo, False)):
        g = pos.shape[0]
        if g >= k:
            out.append(_take_kth(pos, vals, k, largest))
            continue
        at = _first_equal(a, q, k - g)
        if at is None:
            return None
        out.append(np.sort(np.concatenate([pos, at])) if g else at)
    return out[0], out[1]


def _first_equal(a: np.ndarray, q: np.float32, m: int) -> np.ndarray | None:
    """The first ``m`` positions of ``a == q``, ascending (None where there are fewer): a scan by
    cache-sized chunks that stops once it has them."""
    got: list[np.ndarray] = []
    count = 0
    for start in range(0, a.shape[0], _CPU_CHUNK):
        idx = np.flatnonzero(a[start : start + _CPU_CHUNK] == q)[: m - count]
        if idx.size:
            got.append(idx + start)
            count += idx.size
            if count == m:
                return np.concatenate(got) if len(got) > 1 else got[0]
    return None


#: Below this many values, or when ``r`` is above 1/_ORDER_STEP of them, :func:`_order_stats`
#: partitions the whole array; above, it partitions a prefiltered tail (a few times r values).
_ORDER_MIN = 1 << 13
_ORDER_STEP = 16

#: Up to this many values, :func:`_order_stats` runs the C kernel's quickselect on a copy (above,
#: the tail prefilter reads less).
_KERNEL_ORDER_MAX = 1 << 16


def _order_stats(a: np.ndarray, r: int) -> tuple[np.float32, np.float32]:
    """``(sorted(a)[r - 1], sorted(a)[n - r])`` exactly: the ``r``-th smallest and ``r``-th
    largest of finite float32 ``a`` (``1 <= r <= n``), leaving ``a`` unchanged.

    A partition costs several passes over ``a``; for large ``a`` and small ``r`` the answer is
    taken from the tails instead: bounds ``q_lo <= q_hi`` are read off every ``_ORDER_STEP``-th
    value (about twice the share of ``r`` from each end), and when at least ``r`` values lie at
    or beyond a bound, the ``r``-th most extreme value of the whole array is the ``r``-th most
    extreme of those (exact whatever the bounds; otherwise the whole array is partitioned).
    """
    n = a.shape[0]
    kernel = _KERNEL
    if kernel is not None and n <= _KERNEL_ORDER_MAX and a.dtype == np.float32 and a.flags.c_contiguous:
        found = kernel.order_stats(a, r, _scratch("f32", n, np.float32))
        if found is not None:
            return np.float32(found[0]), np.float32(found[1])
    if n < _ORDER_MIN or r * _ORDER_STEP > n:
        if 2 * r <= n:  # two single-kth partitions: NumPy's multi-kth partition is several times slower
            lo_part = np.partition(a, r - 1)
            return lo_part[r - 1], np.partition(lo_part[r:], n - 2 * r)[n - 2 * r]
        ordered = np.sort(a)
        return ordered[r - 1], ordered[n - r]
    q_lo, q_hi = _tail_bounds(a, r)
    below, above = a[a <= q_lo], a[a >= q_hi]
    if below.shape[0] < r or above.shape[0] < r:
        lo_part = np.partition(a, r - 1)
        return lo_part[r - 1], np.partition(lo_part[r:], n - 2 * r)[n - 2 * r]
    t_lo = np.partition(below, r - 1)[r - 1]
    t_hi = np.partition(above, above.shape[0] - r)[above.shape[0] - r]
    return t_lo, t_hi


def _take_extremes(pos: np.ndarray, vals: np.ndarray, t: np.float32, k: int, largest: bool) -> np.ndarray:
    """Of candidates ``pos`` (ascending) holding ``vals``: every one beyond ``t`` and the first
    of those equal to ``t``, ``k`` in all, ascending (the whole-array rule of
    :func:`_extreme_positions_cpu` on the candidates)."""
    return pos[_keep_extremes(vals, t, k, largest)]


def _keep_extremes(vals: np.ndarray, t: np.float32, k: int, largest: bool) -> np.ndarray:
    """The mask of :func:`_take_extremes` over the candidates' values."""
    keep = vals > t if largest else vals < t
    at = np.flatnonzero(vals == t)[: k - int(np.count_nonzero(keep))]
    keep[at] = True
    return keep


def _tail_bounds(a: np.ndarray, r: int) -> tuple[np.float32, np.float32]:
    """Bounds ``q_lo <= q_hi`` read off every ``step``-th value of ``a``, beyond which about
    twice the share of the ``r`` most extreme values lies (:func:`_order_stats`). The step is
    ``_ORDER_STEP``, or larger where the subsample would still hold over 512 values beyond each
    bound (about 4 % noise: the bounds only decide how much is scanned, never the result)."""
    step = max(_ORDER_STEP, r // 256)
    sub = a[::step]
    m = sub.shape[0]
    j = min(m, 2 * (r // step) + 8)
    lo_part = np.partition(sub, j - 1)  # two single-kth partitions: a multi-kth one is slower
    return lo_part[j - 1], np.partition(lo_part[j:], m - 2 * j)[m - 2 * j] if 2 * j <= m else np.sort(sub)[m - j]


def _extreme_positions_torch(flat: torch.Tensor, k: int, largest: bool) -> torch.Tensor:
    """Ascending positions of the ``k`` largest (smallest) entries, ties going to the lowest
    index (the device-generic version of :func:`_extreme_positions_cpu`)."""
    n = flat.numel()
    if k >= n:  # only for n == 1
        return torch.arange(n, device=flat.device)
    vals, pos = torch.topk(flat, k + 1, largest=largest)  # sorted, most extreme first
    if bool(vals[k] != vals[k - 1]):  # no tie across the boundary: the selection is unique
        return pos[:k].sort().values
    t = vals[k - 1]
    strict = ((flat > t) if largest else (flat < t)).nonzero().view(-1)
    at = (flat == t).nonzero().view(-1)[: k - strict.numel()]
    return torch.cat([strict, at]).sort().values


def _threshold_select_cpu(
    a: np.ndarray, thr_hi: np.float32, thr_lo: np.float32, limit: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Ascending positions and values of ``a >= thr_hi`` and of ``a <= thr_lo``, or None when
    the two selections hold more than ``limit`` entries together.

    Walks ``a`` in cache-sized chunks, so it is read from memory once and the mask never leaves
    the cache (NumPy's compare and nonzero are several times faster than torch's on CPU, and
    release the GIL). Large tensors are split into contiguous parts scanned by
    ``torch.get_num_threads()`` threads; the parts are joined in order, so the result does not
    depend on the thread count.
    """
    scan = _scan_values if _KERNEL is None else _scan_values_native
    parts = split_run(lambda begin, end: scan(a, begin, end, thr_hi, thr_lo, limit), a.shape[0], _CPU_CHUNK)
    scanned = [part for part in parts if part is not None]
    if len(scanned) < len(parts):
        return None
    if len(scanned) == 1:
        hi, hi_vals, lo, lo_vals = scanned[0]
    else:
        hi, hi_vals, lo, lo_vals = (np.concatenate([part[i] for part in scanned]) for i in range(4))
    if hi.size + lo.size > limit:
        return None
    return hi, hi_vals, lo, lo_vals


def _fast_select_native(
    kernel: Any, flat: torch.Tensor, where: torch.Tensor, r: int, k: int
) -> tuple[torch.Tensor, float] | None:
    """:meth:`SBC._fast_select` on CPU for a tensor scanned in one part: the sample's thresholds,
    the scan and both sides' sums in one kernel call (the same selection as the calls it fuses:
    tested), so the GIL is taken once per tensor rather than at each step."""
    limit = 4 * k
    cap = max(0, min(limit, flat.numel()))  # the most one side can hold
    hi, lo = _scratch("hi", cap, np.int64), _scratch("lo", cap, np.int64)
    hi_vals, lo_vals = _scratch("hi_vals", cap, np.float32), _scratch("lo_vals", cap, np.float32)
    s = where.numel()
    found = kernel.fast_select(
        flat.numpy(), where.numpy(), r, limit, _scratch("f32", 2 * s, np.float32), hi, hi_vals, lo, lo_vals
    )
    if found is None:
        return None  # a sampled NaN or infinity (exact mode reports it), or too many selected
    nhi, nlo = found[0], found[1]
    if not (0 < nhi <= 2 * k and 0 < nlo <= 2 * k):
        return None
    chosen = _choose(flat, hi[:nhi], hi_vals[:nhi], lo[:nlo], lo_vals[:nlo], stats=(found[2:5], found[5:8]))
    if chosen is None:
        return None
    idx, mean = chosen
    return idx.clone(), mean  # off the thread's scratch, which the next call reuses


def _split_parts(n: int, per: int = _PARALLEL_MIN) -> int:
    """How many parts :func:`split_run` divides ``n`` items into here and now, one per ``per``
    (1: it runs ``fn`` once, on the calling thread)."""
    return 1 if _in_lane() else max(1, min(torch.get_num_threads(), n // max(1, per), _MAX_WORKERS))


def _scan(
    a: np.ndarray, begin: int, end: int, thr_hi: np.float32, thr_lo: np.float32, limit: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Positions in ``[begin, end)`` of ``a >= thr_hi`` and of ``a <= thr_lo`` (None past ``limit``)."""
    found = _scan_values(a, begin, end, thr_hi, thr_lo, limit)
    return None if found is None else (found[0], found[2])


def _scan_values(
    a: np.ndarray, begin: int, end: int, thr_hi: np.float32, thr_lo: np.float32, limit: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Positions and values in ``[begin, end)`` of ``a >= thr_hi`` and of ``a <= thr_lo`` (None
    past ``limit`` or for a NaN); the values are taken from each chunk while it is in cache."""
    mask = np.empty(min(_CPU_CHUNK, end - begin), dtype=bool)
    out: tuple[list[np.ndarray], ...] = ([np.zeros(0, dtype=np.int64)], [a[:0]], [np.zeros(0, dtype=np.int64)], [a[:0]])
    count = 0
    for start in range(begin, end, _CPU_CHUNK):
        part = a[start : min(start + _CPU_CHUNK, end)]
        if math.isnan(float(part.sum(dtype=np.float64))):  # (a NaN selects on neither side)
            return None
        m = mask[: part.shape[0]]
        np.greater_equal(part, thr_hi, out=m)
        hi = m.nonzero()[0]  # flatnonzero's wrappers cost more than the call on a chunk
        np.less_equal(part, thr_lo, out=m)
        lo = m.nonzero()[0]
        count += hi.size + lo.size
        if count > limit:
            return None
        for i, found in ((0, hi), (2, lo)):
            if found.size:
                out[i + 1].append(part[found])
                if start:
                    found += start
                out[i].append(found)
    return tuple(np.concatenate(x) if len(x) > 1 else x[0] for x in out)  # type: ignore[return-value]


def _scan_values_native(
    a: np.ndarray, begin: int, end: int, thr_hi: np.float32, thr_lo: np.float32, limit: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """:func:`_scan_values` in one pass of the C kernel (the same positions and values)."""
    assert _KERNEL is not None
    cap = max(0, min(limit, end - begin))  # the most one side can hold
    hi, lo = _scratch("hi", cap, np.int64), _scratch("lo", cap, np.int64)
    hi_vals, lo_vals = _scratch("hi_vals", cap, np.float32), _scratch("lo_vals", cap, np.float32)
    found = _KERNEL.scan(a, begin, end, thr_hi, thr_lo, limit, hi, hi_vals, lo, lo_vals)
    if found is None:
        return None
    nhi, nlo = found  # copied out of the thread's buffers, which the next scan reuses
    return hi[:nhi].copy(), hi_vals[:nhi].copy(), lo[:nlo].copy(), lo_vals[:nlo].copy()


#: Per-thread work buffers of the kernels (see :func:`_scratch`).
_SCRATCH = threading.local()

#: Largest work buffer kept for reuse, in elements (larger ones are allocated per call).
_SCRATCH_MAX = 1 << 20


def _scratch(key: str, size: int, dtype: type) -> np.ndarray:
    """An uninitialised work buffer of ``size`` elements, reused by later calls on the same thread.

    A fresh large NumPy array is fresh pages from the kernel, each costing a page fault when
    first written: for the kernels' buffers (a few hundred KB per tensor) that costs more than
    the kernel itself. The caller must not keep the buffer (or a view of it) past its next call."""
    if size > _SCRATCH_MAX:
        return np.empty(size, dtype=dtype)
    buf: np.ndarray | None = getattr(_SCRATCH, key, None)
    if buf is None or buf.shape[0] < size:
        buf = np.empty(max(size, 1 << 12), dtype=dtype)
        setattr(_SCRATCH, key, buf)
    return buf[:size]


_POOL: tuple[int, ThreadPoolExecutor] | None = None

T = TypeVar("T")


def split_run(fn: Callable[[int, int], T], n: int, align: int, parallel_min: int | None = None) -> list[T]:
    """``[fn(b_0, b_1), fn(b_1, b_2), ...]``: ``fn`` over contiguous parts of ``[0, n)`` whose
    inner bounds are multiples of ``align``, in order. Up to ``torch.get_num_threads()`` parts
    (at most ``_MAX_WORKERS``, one per ``parallel_min`` items, default ``_PARALLEL_MIN``) run at
    once on the process-wide pool, the first on the calling thread; ``fn`` must release the GIL
    for its heavy work (NumPy ufuncs do) and write only its own part. Joined in order, so a
    result that depends only on the parts' concatenation does not depend on the thread count."""
    workers = _split_parts(n, _PARALLEL_MIN if parallel_min is None else parallel_min)
    if workers <= 1:
        return [fn(0, n)]
    bounds = [(n * i // workers) // align * align for i in range(workers)] + [n]
    pool = _pool()
    futures = [pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, workers)]
    return [fn(bounds[0], bounds[1])] + [f.result() for f in futures]


#: Marks the threads running :func:`run_jobs`' lanes: there every thread already has a job.
_LANE = threading.local()


def _in_lane() -> bool:
    return getattr(_LANE, "busy", False)


def team_threads() -> tuple[int, bool]:
    """``(threads, use_team)`` for a C kernel that takes a list of tasks on the CPU threads
    (``team.h``): torch's threads, at most ``_MAX_WORKERS``, one inside a :func:`run_jobs` lane
    (every thread has a job there); torch's OpenMP team only in the process that loaded it."""
    threads = 1 if _in_lane() else max(1, min(torch.get_num_threads(), _MAX_WORKERS))
    return threads, os.getpid() == _KERNEL_PID


def run_jobs(jobs: Sequence[Callable[[], T]], costs: Sequence[int], local: Sequence[bool] = ()) -> list[T]:
    """``[job() for job in jobs]``, with up to ``torch.get_num_threads()`` jobs running at once.

    For many independent tensors (a whole update): one lane per thread, the first on the calling
    thread, each taking the next job of largest ``cost`` when it is done; inside a job
    :func:`split_run` runs serially (every thread already has a job). The jobs must release the
    GIL for their heavy work and touch nothing another job touches. A job marked in ``local``
    runs on the calling thread while the other lanes start, before it joins them (one that holds
    the GIL throughout, e.g. a small dense tensor, gains nothing in a lane). With one thread,
    or fewer than two lane jobs, a plain loop. Otherwise every job runs even when one raises;
    then the exception of the earliest job in ``jobs`` is raised, as a loop would."""
    here = [i < len(local) and local[i] for i in range(len(jobs))]
    in_lanes = [i for i, h in enumerate(here) if not h]
    workers = 1 if _in_lane() else min(torch.get_num_threads(), len(in_lanes), _MAX_WORKERS)
    if workers <= 1:
        return [job() for job in jobs]
    results: dict[int, T] = {}
    errors: dict[int, Exception] = {}

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except Exception as e:  # re-raised below, in job order
            errors[i] = e

    pending = iter(sorted(in_lanes, key=lambda i: -costs[i]))
    take = threading.Lock()

    def lane() -> None:
        _LANE.busy = True
        try:
            while True:
                with take:
                    i = next(pending, None)
                if i is None:
                    return
                run(i)
        finally:
            _LANE.busy = False

    futures = [_pool().submit(lane) for _ in range(workers - 1)]
    _LANE.busy = True  # (split_run stays serial in these too: the other lanes have the threads)
    try:
        for i in (i for i, h in enumerate(here) if h):  # while the other lanes start on the largest
            run(i)
    finally:
        _LANE.busy = False
    lane()
    for f in futures:
        f.result()
    if errors:
        raise errors[min(errors)]
    return [results[i] for i in range(len(jobs))]


def _pool() -> ThreadPoolExecutor:
    """A process-wide thread pool, rebuilt after a fork (a forked child has no pool threads). Its
    threads run torch's operators on themselves alone (:func:`serial_torch_thread`)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (
            os.getpid(),
            ThreadPoolExecutor(_MAX_WORKERS - 1, thread_name_prefix="fedcomp-sbc", initializer=serial_torch_thread),
        )
    return _POOL[1]


def serial_torch_thread() -> None:
    """Make torch's parallel operators run on the calling thread alone, for this thread only.

    torch's CPU operators run on an OpenMP team, one per thread that calls them. A pool thread
    that ran one kept a team of its own, and from then on the process had more OpenMP threads
    than cores: libgomp then stops its idle workers spinning, for every team, so each operator
    of the main thread's waited for its workers to wake (on the 2-core build machine, the
    server's replica distance over a ResNet-50 took 92-185 ms after a client's first SBC encode,
    26 ms before it). A pool thread has its job and the other threads theirs anyway (as
    :func:`split_run` stays serial in a lane). OpenMP's thread count is a setting of each thread;
    torch sets it on a thread's first question about it, so it is asked first, then set to one.
    Without an OpenMP runtime found, nothing changes."""
    torch.get_num_threads()
    try:
        set_threads = ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError, TypeError):
        return
    set_threads(1)


def _threshold_select_torch(
    flat: torch.Tensor, thr_hi: np.float32, thr_lo: np.float32, limit: int
) -> tuple[torch.Tensor, np.ndarray, torch.Tensor, np.ndarray] | None:
    """:func:`_threshold_select_cpu` for any device: positions stay on it, values come back
    (None for a NaN, which selects on neither side: exact mode names it)."""
    if bool(torch.isnan(flat).any()):
        return None
    hi = (flat >= float(thr_hi)).nonzero().view(-1)
    lo = (flat <= float(thr_lo)).nonzero().view(-1)
    if hi.numel() + lo.numel() > limit:
        return None
    return hi, flat[hi].cpu().numpy(), lo, flat[lo].cpu().numpy()


@lru_cache(maxsize=256)
def _sample_positions_np(n: int, s: int) -> np.ndarray:
    """:func:`_sample_positions` on CPU, as the NumPy array the kernels take."""
    return _sample_positions(n, s, "cpu").numpy()


@lru_cache(maxsize=128)
def _sample_positions(n: int, s: int, device: str) -> torch.Tensor:
    """``s`` positions in ``[0, n)``, ascending: one per stratum ``[j n / s, (j + 1) n / s)``,
    jittered by splitmix64 of ``j``. Pure integer arithmetic, so the same on every platform."""
    j = np.arange(s + 1, dtype=np.uint64)
    qn, rn = divmod(n, s)
    starts = j * np.uint64(qn) + (j * np.uint64(rn)) // np.uint64(s)
    widths = starts[1:] - starts[:-1]  # each >= 1 since s < n
    z = j[:-1] + np.uint64(_SAMPLE_SEED) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    pos = (starts[:-1] + z % widths).astype(np.int64)
    return torch.from_numpy(pos).to(device)


# --- exact means ----------------------------------------------------------------------------


def _exact_sum(vals: np.ndarray, stats: Sequence[float] | None = None) -> int | None:
    """The exact sum of float32 ``vals`` as an integer multiple of 2**-149; None if any value is
    infinite or NaN.

    Every float32 with biased exponent ``e`` is a multiple of ``2**(max(e, 1) - 150)`` below
    ``2**(e - 126)``. When the exponents span little enough that the total stays below 2**53 of
    the smallest such unit, every partial sum is exactly representable in float64, so a float64
    sum is exact in any order (the common case). Otherwise the signed 24-bit mantissas are summed
    per exponent as integers and the bins combined as Python integers.
    """
    count = vals.shape[0]
    if count == 0:
        return 0
    kernel = _KERNEL
    total: float | None = None
    if stats is not None:  # the kernel's sum_stats of vals, already computed
        total, mag_lo, mag_hi = float(stats[0]), int(stats[1]), int(stats[2])
        lo, hi = max(mag_lo >> 23, 1), mag_hi >> 23
    elif kernel is not None and vals.dtype == np.float32 and vals.flags.c_contiguous:
        # one pass: the float64 sum in order, and the least and greatest bits of |v|
        total, mag_lo, mag_hi = kernel.sum_stats(vals)
        lo, hi = max(mag_lo >> 23, 1), mag_hi >> 23
    else:
        magnitude = vals.view(np.int32) & 0x7FFFFFFF  # the bits of |v|: ordered like |v|
        lo, hi = max(int(magnitude.min()) >> 23, 1), int(magnitude.max()) >> 23
    if hi == 0xFF:
        return None
    if hi - lo + 24 + count.bit_length() <= 53:
        if total is None:
            total = float(vals.sum(dtype=np.float64))
        return _units(total)
    raw = vals.view(np.int32)
    e = (raw >> 23) & 0xFF
    m = ((raw & 0x7FFFFF) | ((e > 0).astype(np.int32) << 23)).astype(np.int64)
    m = np.where(raw < 0, -m, m)
    bins = np.zeros(255, dtype=np.int64)
    np.add.at(bins, np.maximum(e, 1), m)  # |bin| < count * 2**24: no int64 overflow
    return sum(int(v) << (i - 1) for i, v in enumerate(bins.tolist()) if v)


def _units(total: float) -> int:
    """An exact float64 sum of float32 values in units of ``2**-149`` (the least subnormal): its
    denominator is a power of two, at most ``2**149``."""
    num, den = total.as_integer_ratio()
    return num * ((1 << 149) // den)


def _kernel_mean(total: float, nnz: int, b: int, n: int) -> float | None:
    """The float32 mean of a side the C kernel chose and coded (``total`` its exact sum over
    ``nnz`` of ``n`` values, ``b`` its Golomb parameter), or None where the kernel's ``b`` is not
    :func:`golomb_b`'s (the kernel's libm and Python's agree; were they not, Python's path runs)."""
    if b != golomb_b(nnz / n):
        return None
    return _round_f32(_units(total), nnz << 149)


def _round_f32(num: int, den: int) -> float:
    """``num / den`` (``den > 0``) rounded to the nearest float32, ties to even."""
    if num == 0:
        return 0.0
    a = abs(num)
    t = a.bit_length() - den.bit_length()  # floor(log2(a / den)) is t or t - 1
    if (a << -t if t < 0 else a) < (den << t if t > 0 else den):
        t -= 1
    e = max(t - 23, -149)  # exponent of the last mantissa bit (subnormals: 2**-149)
    n2, d2 = (a, den << e) if e >= 0 else (a << -e, den)
    mant, rem = divmod(n2, d2)
    if 2 * rem > d2 or (2 * rem == d2 and mant & 1):
        mant += 1
    out = math.ldexp(mant, e)  # mant <= 2**24: exact in float64, representable in float32
    return -out if num < 0 else out


def _choose(
    flat: torch.Tensor,
    hi: Positions,
    hi_vals: np.ndarray,
    lo: Positions,
    lo_vals: np.ndarray,
    stats: tuple[Sequence[float], Sequence[float]] | None = None,
) -> tuple[torch.Tensor, float] | None:
    """Keep the side with the larger mean magnitude (the positive side on a tie): its positions
    (a tensor on ``flat``'s device) and its mean rounded to float32. None if a value is not
    finite. ``stats``: each side's ``sum_stats``, when the kernel already computed them."""
    chosen = choose_side(hi, hi_vals, lo, lo_vals, stats)
    if chosen is None:
        return None
    idx, mean = chosen
    if isinstance(idx, np.ndarray):
        idx = torch.from_numpy(idx)
    return idx.to(flat.device), mean


def choose_side(
    hi: Positions,
    hi_vals: np.ndarray,
    lo: Positions,
    lo_vals: np.ndarray,
    stats: tuple[Sequence[float], Sequence[float]] | None = None,
) -> tuple[Positions, float] | None:
    """:func:`_choose` where the positions stay what they are (a NumPy array stays one): the
    side's positions and its mean rounded to float32, or None if a value is not finite. The
    whole-update engine (:mod:`fedcomp.codecs.sbc_device`) calls it with the candidates it
    brought to the host."""
    s_hi = _exact_sum(hi_vals, None if stats is None else stats[0])
    s_lo = _exact_sum(lo_vals, None if stats is None else stats[1])
    if s_hi is None or s_lo is None:
        return None
    c_hi, c_lo = len(hi_vals), len(lo_vals)
    # mu+ = s_hi / c_hi, mu- = -s_lo / c_lo (units of 2**-149)
    if s_hi * c_lo >= -s_lo * c_hi:
        return hi, _round_f32(s_hi, c_hi << 149)
    return lo, _round_f32(s_lo, c_lo << 149)


@dataclass(frozen=True)
class FlatSides:
    """What :func:`choose_sides_flat` found: per tensor ``(mean, nnz, golomb_b, bits, positive)``
    (the side's mean rounded to float32, its count, Golomb parameter and code; ``positive``: the
    high side) or None where the caller is left to do it (:func:`choose_side`: no kernel, sums a
    float64 cannot hold exactly); and, where no tensor was left, every tensor's kept positions as
    given and its mean at each, in tensor order (else None)."""

    sides: list[tuple[float, int, int, bytes, bool] | None]
    kept: np.ndarray | None
    value: np.ndarray | None


def choose_sides_flat(
    positions: np.ndarray, values: np.ndarray, ranges: np.ndarray, bases: np.ndarray, numels: np.ndarray
) -> FlatSides:
    """:func:`choose_side` and the Golomb code of the side chosen for many tensors at once, their
    candidates laid out flat (what the whole-update engine, :mod:`fedcomp.codecs.sbc_device`,
    brings to the host in one copy): ``positions`` (int64, or int32 as a device copied them: then
    the kept positions are int32 too; ascending within a side, tensor ``i``'s in ``[bases[i],
    bases[i] + numels[i])``) and their float32 ``values``; tensor ``i``'s high side
    ``positions[ranges[i, 0]:ranges[i, 1]]``, its low side ``positions[ranges[i, 2]:ranges[i, 3]]``.
    One call of the C kernel (``sides_flat``, on the CPU threads) with no Python object per tensor
    but its result: the same sides, means and codes as :func:`choose_side` with
    :func:`~fedcomp.codecs.golomb.encode_positions` (tested)."""
    count = int(bases.shape[0])
    kernel = _KERNEL
    if kernel is None or not hasattr(kernel, "sides_flat") or not count:
        return FlatSides([None] * count, None, None)
    pos_dtype = np.int32 if positions.dtype == np.int32 else np.int64
    lengths = ranges[:, 1::2] - ranges[:, 0::2]
    room = int(lengths.max(axis=1).sum())
    kept, value = np.empty(room, pos_dtype), np.empty(room, np.float32)
    positions = np.ascontiguousarray(positions, dtype=pos_dtype)
    values = np.ascontiguousarray(values, dtype=np.float32)
    sides, written = kernel.sides_flat(
        positions,
        values,
        np.ascontiguousarray(ranges, dtype=np.int64),
        np.ascontiguousarray(bases, dtype=np.int64),
        np.ascontiguousarray(numels, dtype=np.int64),
        pos_dtype is np.int64,
        LN_PHI_MINUS_1,
        *team_threads(),
        kept,
        value,
    )
    for i, side in enumerate(sides):
        # the kernel's b is golomb_b's (its libm and Python's agree; were they not, Python codes it)
        if side is not None and side[2] != golomb_b(side[1] / int(numels[i])):
            mean, nnz, _, _, positive = side
            r = ranges[i]
            idx = (positions[r[0] : r[1]] if positive else positions[r[2] : r[3]]).astype(np.int64)
            b = golomb_b(nnz / int(numels[i]))
            sides[i] = (mean, nnz, b, encode_positions(torch.from_numpy(idx - bases[i]), b), positive)
    if written < 0:
        return FlatSides(sides, None, None)
    return FlatSides(sides, kept[:written], value[:written])
