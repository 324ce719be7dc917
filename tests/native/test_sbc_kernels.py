"""SBC's C kernels (fedcomp/_native/sbc.c) against the NumPy paths they replace: the same positions,
values, sums, bytes and errors, on sizes around block, chunk and thread-split boundaries, ties,
zeros, one-sided tensors, over-limit scans, every Golomb parameter and hostile bitstreams."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import fedcomp.codecs.golomb as golomb
import fedcomp.codecs.sbc as sbc
from fedcomp import _native
from fedcomp.codecs import get_codec
from fedcomp.codecs.dense import DenseFP32
from fedcomp.errors import PayloadError
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.wire import serde
from tests.codecs import reference_sbc as ref
from tests.native.variants import available

KERNEL = _native.load("sbc")
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="fedcomp._native._sbc is not built or FEDCOMP_NATIVE=0")

#: Sizes around the scan's 16-element blocks and the NumPy path's 65536-element chunks.
SIZES = [0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1000, 65535, 65536, 65537, 131_073]


def test_the_kernel_is_built_and_in_use():
    """CI notices a build that silently failed: the optional extension must be there."""
    if not _native.enabled():
        pytest.skip("FEDCOMP_NATIVE=0: the kernels are switched off on purpose")
    assert os.environ.get("FEDCOMP_NATIVE", "1").strip() != "0"
    assert KERNEL is not None, "fedcomp._native._sbc failed to build or import"
    assert sbc._KERNEL is KERNEL and golomb._KERNEL is KERNEL
    assert _native.status()["sbc"]


def values(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, n)
    if kind == "levels":  # few distinct values: ties at the thresholds
        x = np.round(x * 2) / 2
    elif kind == "zeros":
        x = np.where(rng.random(n) < 0.01, x, 0.0)
    elif kind == "negative":
        x = -np.abs(x) - 0.5
    elif kind == "tiny":  # subnormals and signed zeros
        x = x * 1e-40
        x[::7] = -0.0
    return x.astype(np.float32)


def thresholds(a: np.ndarray, rng: np.random.Generator) -> list[tuple[np.float32, np.float32]]:
    """Threshold pairs: quantiles, exact values of ``a`` (ties), crossed (lo > hi: an entry on both
    sides), and thresholds that select everything or nothing."""
    out = [(np.float32(0.0), np.float32(0.0)), (np.float32(np.inf), np.float32(-np.inf))]
    out.append((np.float32(-np.inf), np.float32(np.inf)))
    if a.size:
        for q in (0.9, 0.99, 0.999):  # 0.999: the AVX2 scan's loop for sparse selections
            out.append((np.float32(np.quantile(a, q)), np.float32(np.quantile(a, 1 - q))))
        pick = a[rng.integers(0, a.size, 2)]
        out.append((pick.max(), pick.min()))
        out.append((pick.min(), pick.max()))
    return out


def scan_variants() -> list[str]:
    """The scan variants this CPU can run (the kernel picks the fastest at import)."""
    if KERNEL is None:
        return ["base"]
    return available(KERNEL.scan_variant, ("base", "avx2"))


@pytest.fixture(params=scan_variants())
def variant(request):
    """Run the test with each scan variant, then restore the one chosen at import."""
    assert KERNEL is not None
    current = KERNEL.scan_variant()
    KERNEL.scan_variant(request.param)
    yield request.param
    KERNEL.scan_variant(current)


@needs_kernel
@pytest.mark.parametrize("kind", ["student", "levels", "zeros", "negative", "tiny"])
@pytest.mark.parametrize("n", SIZES)
def test_scan_equals_numpy(kind, n, variant):
    a = values(kind, n, seed=n + 1)
    rng = np.random.default_rng(n)
    for thr_hi, thr_lo in thresholds(a, rng):
        want = sbc._scan_values(a, 0, n, thr_hi, thr_lo, limit=2 * n + 1)
        assert want is not None
        count = want[0].size + want[2].size
        for begin, end in ((0, n), (n // 3, n), (n // 2 - 1 if n > 2 else 0, n // 2 + 17 if n > 40 else n)):
            begin, end = max(0, begin), min(n, end)
            for limit in sorted({0, 1, count - 1, count, count + 1, 2 * n + 5}):
                if limit < 0:
                    continue
                got = sbc._scan_values_native(a, begin, end, thr_hi, thr_lo, limit)
                exp = sbc._scan_values(a, begin, end, thr_hi, thr_lo, limit)
                assert (got is None) == (exp is None), (begin, end, limit)
                if got is not None and exp is not None:
                    for g, e in zip(got, exp, strict=True):
                        assert g.dtype == e.dtype and g.tobytes() == e.tobytes()


@needs_kernel
@pytest.mark.parametrize("where", [0, 17, 4090, 4999])  # (in the blocks and in the tail)
def test_a_scan_over_a_nan_says_so(variant, where: int) -> None:
    """A NaN selects on neither side, so a scan that passed it by would leave it behind unseen:
    the kernel's scans (and NumPy's) give None for it, as for too many selected."""
    a = values("student", 5000, seed=9)
    assert sbc._scan_values_native(a, 0, a.size, np.float32(1.0), np.float32(-1.0), 10**6) is not None
    a[where] = np.nan
    assert sbc._scan_values_native(a, 0, a.size, np.float32(1.0), np.float32(-1.0), 10**6) is None
    assert sbc._scan_values(a, 0, a.size, np.float32(1.0), np.float32(-1.0), 10**6) is None


@needs_kernel
@pytest.mark.parametrize("kind", ["student", "levels", "zeros"])
def test_threaded_threshold_select_equals_numpy(kind, monkeypatch, variant):
    """Several threads' parts, joined in order, over limit or not: as the NumPy path."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(sbc, "_PARALLEL_MIN", 1000)
    monkeypatch.setattr(sbc, "_CPU_CHUNK", 512)
    a = values(kind, 100_003, seed=5)
    for thr_hi, thr_lo in thresholds(a, np.random.default_rng(1)):
        for limit in (10, 2000, 10**6):
            got = sbc._threshold_select_cpu(a, thr_hi, thr_lo, limit)
            monkeypatch.setattr(sbc, "_KERNEL", None)
            exp = sbc._threshold_select_cpu(a, thr_hi, thr_lo, limit)
            monkeypatch.setattr(sbc, "_KERNEL", KERNEL)
            assert (got is None) == (exp is None)
            if got is not None and exp is not None:
                assert all(g.tobytes() == e.tobytes() for g, e in zip(got, exp, strict=True))


@needs_kernel
def test_kernel_argument_checks_raise_value_error():
    assert KERNEL is not None
    a = np.zeros(100, dtype=np.float32)
    small = np.empty(3, dtype=np.int64)
    ok_pos, ok_val = np.empty(100, dtype=np.int64), np.empty(100, dtype=np.float32)
    with pytest.raises(ValueError):
        KERNEL.scan(a, 0, 101, 1.0, -1.0, 100, ok_pos, ok_val, ok_pos, ok_val)
    with pytest.raises(ValueError):
        KERNEL.scan(a, 50, 10, 1.0, -1.0, 100, ok_pos, ok_val, ok_pos, ok_val)
    with pytest.raises(ValueError):
        KERNEL.scan(a, 0, 100, 1.0, -1.0, 100, small, ok_val, ok_pos, ok_val)
    scratch = np.empty(4, dtype=np.float32)
    for pos, r in (([0, 100], 1), ([0, -1], 1), ([0, 1], 0), ([0, 1], 3)):
        with pytest.raises(ValueError):
            KERNEL.sample_thresholds(a, np.array(pos, dtype=np.int64), r, scratch)
    with pytest.raises(ValueError):
        KERNEL.sample_thresholds(a, np.array([0, 1, 2], dtype=np.int64), 1, scratch)  # 2 * 3 floats needed
    with pytest.raises(ValueError):
        KERNEL.golomb_encode(np.array([3, 3], dtype=np.int64), 2)
    with pytest.raises(ValueError):
        KERNEL.golomb_encode(np.array([-1], dtype=np.int64), 2)
    with pytest.raises(ValueError):
        KERNEL.golomb_encode(np.array([1], dtype=np.int64), 63)
    with pytest.raises(ValueError):
        KERNEL.golomb_decode(b"\x00", 2, 0, 10, np.empty(1, dtype=np.int64))
    with pytest.raises(ValueError):
        KERNEL.golomb_decode(b"\x00", 11, 0, 10, np.empty(11, dtype=np.int64))
    with pytest.raises(TypeError):  # read-only output
        KERNEL.golomb_decode(b"\x00", 1, 0, 10, np.zeros(1, dtype=np.int64).tobytes())


def _sides_flat(tasks, threads: int = 2, room: int | None = None):
    """``sides_flat`` of ``[(hi_pos, hi_vals, lo_pos, lo_vals, n, base), ...]`` laid out flat."""
    assert KERNEL is not None
    pos, val, ranges, at = [], [], [], 0
    for hp, hv, lp, lv, _, _ in tasks:
        ranges.append([at, at + len(hp), at + len(hp), at + len(hp) + len(lp)])
        pos += [hp, lp]
        val += [hv, lv]
        at += len(hp) + len(lp)
    room = sum(max(len(t[0]), len(t[2])) for t in tasks) if room is None else room
    kept, value = np.zeros(room, np.int64), np.zeros(room, np.float32)
    flat_pos = np.concatenate(pos) if pos else np.zeros(0, np.int64)
    flat_val = np.concatenate(val) if val else np.zeros(0, np.float32)
    args = (np.array(ranges, np.int64).reshape(-1, 4), np.array([t[5] for t in tasks], np.int64))
    sides, count = KERNEL.sides_flat(
        flat_pos, flat_val, *args, np.array([t[4] for t in tasks], np.int64), True,
        golomb.LN_PHI_MINUS_1, threads, False, kept, value,
    )  # fmt: skip
    return sides, count, kept, value


@needs_kernel
def test_sides_flat_checks_its_arguments_and_leaves_what_it_cannot_code():
    assert KERNEL is not None
    pos, val = np.array([1, 4], dtype=np.int64), np.array([0.5, 2.0], dtype=np.float32)
    neg = np.array([2], dtype=np.int64), np.array([-1.0], dtype=np.float32)
    b = golomb.golomb_b(0.2)
    code = KERNEL.golomb_encode(pos, b)
    for base in (0, 1000):  # positions are base + the tensor's own, coded less base
        ok = (pos + base, val, neg[0] + base, neg[1], 10, base)
        sides, count, kept, value = _sides_flat([ok])
        assert sides == [(1.25, 2, b, code, True)] and count == 2
        assert kept.tolist() == [1 + base, 4 + base] and value.tolist() == [1.25, 1.25]
    ok = (pos, val, *neg, 10, 0)
    lo_wins = (pos + 10, -val, neg[0] + 10, np.array([-5.0], np.float32), 10, 10)
    sides, count, kept, value = _sides_flat([ok, lo_wins])
    assert sides[1] == (-5.0, 1, golomb.golomb_b(0.1), KERNEL.golomb_encode(neg[0], golomb.golomb_b(0.1)), False)
    assert count == 3 and kept.tolist()[:3] == [1, 4, 12] and value.tolist()[:3] == [1.25, 1.25, -5.0]
    flat = np.concatenate([pos, neg[0]])
    flat_v = np.concatenate([val, neg[1]])
    z = np.zeros(1, np.int64)
    room = np.zeros(3, np.int64), np.zeros(3, np.float32)
    for bad in (
        (flat, flat_v[:2], np.array([[0, 2, 2, 3]]), z, z + 10),  # fewer values than positions
        (flat, flat_v, np.array([[0, 2, 2, 4]]), z, z + 10),  # a range past the arrays
        (flat, flat_v, np.array([[2, 1, 2, 3]]), z, z + 10),  # a range that ends before it starts
        (flat, flat_v, np.array([[0, 2, 2, 3]]), z, z),  # no elements
        (flat, flat_v, np.array([[0, 2, 2, 3, 0]]), z, z + 10),  # ranges of 5
    ):
        with pytest.raises(ValueError, match="sides_flat"):
            KERNEL.sides_flat(*bad, True, golomb.LN_PHI_MINUS_1, 1, False, *room)
    with pytest.raises(ValueError, match="sides_flat"):  # int64 positions said to be int32
        KERNEL.sides_flat(flat, flat_v, np.array([[0, 2, 2, 3]]), z, z + 10, False, 0.5, 1, False, *room)
    with pytest.raises(ValueError, match="sides_flat"):  # as many values as kept positions
        KERNEL.sides_flat(flat, flat_v, np.array([[0, 2, 2, 3]]), z, z + 10, True, 0.5, 1, False, room[0], room[1][:2])
    with pytest.raises(TypeError):  # a read-only output
        KERNEL.sides_flat(
            flat,
            flat_v,
            np.array([[0, 2, 2, 3]]),
            z,
            z + 10,
            True,
            0.5,
            1,
            False,
            room[0].tobytes(),
            room[1],
        )
    # positions out of order or past n, a value not finite: left to the Python path (None); then
    # no kept positions are written (count -1)
    for left in (
        (pos[::-1].copy(), val, *neg, 10, 0),
        (pos, val, *neg, 4, 0),
        (pos + 5, val, neg[0] + 5, neg[1], 10, 7),  # below the base
        (pos, np.array([np.inf, 1.0], dtype=np.float32), *neg, 10, 0),
    ):
        sides, count, kept, _ = _sides_flat([ok, left])
        assert sides[0] is not None and sides[1] is None and count == -1 and not kept.any()
    sides, count, _, _ = _sides_flat([ok], room=1)  # no room for the kept positions: none written
    assert sides[0] is not None and count == -1


@needs_kernel
@pytest.mark.parametrize("kind", ["student", "levels", "zeros", "negative", "tiny"])
def test_sample_thresholds_equal_numpy_order_statistics(kind):
    """Fast mode's thresholds: the r-th smallest and largest sampled values, as _order_stats."""
    assert KERNEL is not None
    a = values(kind, 200_000, seed=2)
    for s in (1, 2, 3, 100, 25_600):
        where = sbc._sample_positions(a.size, s, "cpu").numpy()
        sample = a[where]
        for r in sorted({min(s, 2), 1, max(1, s // 100), s // 2 or 1, (s + 1) // 2, s}):
            got = KERNEL.sample_thresholds(a, where, r, np.empty(2 * s, dtype=np.float32))
            want = sbc._order_stats(sample, r)
            assert got == (float(want[0]), float(want[1])), (s, r)


@needs_kernel
@pytest.mark.parametrize("kind", ["student", "levels", "zeros", "negative", "tiny"])
@pytest.mark.parametrize("n", [1, 2, 3, 100, 8191, 8192, 65536, 65537])
def test_order_stats_equal_numpy(kind, n, monkeypatch):
    a = values(kind, n, seed=n)
    for r in sorted({1, min(n, 2), max(1, n // 100), max(1, n // 16), max(1, n // 2), (n + 1) // 2, n}):
        got = sbc._order_stats(a, r)
        monkeypatch.setattr(sbc, "_KERNEL", None)
        want = sbc._order_stats(a, r)
        monkeypatch.setattr(sbc, "_KERNEL", KERNEL)
        assert (float(got[0]), float(got[1])) == (float(want[0]), float(want[1])), r
        assert isinstance(got[0], np.float32) and isinstance(got[1], np.float32)
    assert (
        KERNEL is not None
        and KERNEL.order_stats(np.array([1.0, np.nan], np.float32), 1, np.empty(2, np.float32)) is None
    )


@needs_kernel
def test_sample_thresholds_report_what_is_not_finite():
    assert KERNEL is not None
    a = values("student", 50_000, seed=3)
    where = sbc._sample_positions(a.size, 1000, "cpu").numpy()
    for bad in (np.nan, np.inf, -np.inf):
        b = a.copy()
        b[where[-1]] = bad
        assert KERNEL.sample_thresholds(b, where, 10, np.empty(2000, dtype=np.float32)) is None
        b[where[-1]] = 0.0
        b[where[-1] + 1] = bad  # not sampled: not seen
        assert KERNEL.sample_thresholds(b, where, 10, np.empty(2000, dtype=np.float32)) is not None


@needs_kernel
@pytest.mark.parametrize("kind", ["student", "levels", "zeros", "negative", "tiny", "nan", "inf", "huge"])
@pytest.mark.parametrize("p", [0.001, 0.01, 0.1])
def test_fused_fast_select_equals_the_calls_it_fuses(kind, p, monkeypatch):
    """Fast mode's one-call selection (sample thresholds, scan, both sides' sums: the path of a
    tensor scanned in one part) against the separate kernel calls: the same payload, the same
    fallback to exact mode (ties, masses of zeros, a side beyond its bound) and the same error
    for a sampled NaN or infinity."""
    n = 40_000
    base = "student" if kind in ("nan", "inf", "huge") else kind
    a = values(base, n, seed=int(p * 1e4) + len(kind))
    codec = sbc.SBC(p, "fast", sample_size=2_000)
    if kind in ("nan", "inf"):
        where = sbc._sample_positions(n, codec.sample_size, "cpu").numpy()
        a[where[17]] = np.nan if kind == "nan" else -np.inf
    elif kind == "huge":  # exponents spanning more than float64's exact sums: the binned sum
        a[::97] *= np.float32(1e30)
        a[1::89] *= np.float32(1e-30)
    t = torch.from_numpy(a)
    runs = []
    for fused in (True, False):
        # _split_parts(n) decides the fused call; split_run asks _split_parts(n, per): keep it serial
        monkeypatch.setattr(sbc, "_split_parts", lambda n, per=None, fused=fused: 1 if fused or per is not None else 2)
        try:
            runs.append(codec.encode_with_reconstruction(t, "w"))
        except ValueError as err:
            runs.append(str(err))
    if isinstance(runs[0], str):
        assert runs[0] == runs[1] and kind in ("nan", "inf")
        return
    (got, got_recon), (want, want_recon) = runs
    assert got.payload == want.payload
    assert torch.equal(got_recon, want_recon)


@needs_kernel
@pytest.mark.parametrize("kind", ["student", "levels", "zeros", "negative", "tiny"])
@pytest.mark.parametrize("n", [2, 3, 17, 1000, 8192, 25_601, 65536])
def test_exact_select_of_small_tensors_equals_numpy(kind, n, monkeypatch):
    """Exact mode's kernel path for small tensors (order statistics, then a scan at them): the
    positions and mean of the NumPy path, ties to the lowest index included."""
    flat = torch.from_numpy(values(kind, n, seed=n + 7))
    for k in sorted({1, max(1, round(0.01 * n)), max(1, n // 3), n // 2 or 1}):
        got_idx, got_mean = sbc._exact_select(flat, k, "t")
        monkeypatch.setattr(sbc, "_KERNEL", None)
        want_idx, want_mean = sbc._exact_select(flat, k, "t")
        monkeypatch.setattr(sbc, "_KERNEL", KERNEL)
        assert got_idx.tolist() == want_idx.tolist() and got_mean == want_mean, k
    bad = flat.clone()
    bad[n // 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        sbc._exact_select(bad, 1, "t")


def exact_sum_inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    out = [np.zeros(0, dtype=np.float32), np.array([-0.0], dtype=np.float32)]
    for kind in ("student", "levels", "zeros", "negative", "tiny"):
        out.append(values(kind, 3001, seed=len(out)))
    out.append((rng.standard_normal(500) * 2.0 ** rng.integers(-140, 120, 500)).astype(np.float32))  # slow path
    out.append(np.array([3e38, 3e38, -1e-45], dtype=np.float32))
    for bad in (np.inf, -np.inf, np.nan):
        out.append(np.array([1.0, bad, 2.0], dtype=np.float32))
    return out


@needs_kernel
@pytest.mark.parametrize("i", range(len(exact_sum_inputs())))
def test_exact_sum_equals_numpy(i, monkeypatch):
    vals = exact_sum_inputs()[i]
    got = sbc._exact_sum(vals)
    monkeypatch.setattr(sbc, "_KERNEL", None)
    assert got == sbc._exact_sum(vals)


@needs_kernel
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 9, 13, 64, 1001])
def test_sum_stats_bounds_and_exact_sum_wherever_the_extremes_lie(n: int) -> None:
    """``sum_stats`` (four running sums and bounds, then the tail): the least and greatest
    ``bits & 0x7fffffff`` and, where ``_exact_sum``'s test passes, the exact sum, with the extremes
    at every position (each lane of the four, and the tail)."""
    rng = np.random.default_rng(n)
    base = (rng.standard_normal(n) * 0.5 + 1.0).astype(np.float32)
    for at in range(min(n, 16)) if n else [None]:
        x = base.copy()
        if at is not None:
            x[at] = np.float32(-7.5)  # the largest magnitude
            x[(at + 1) % n] = np.float32(2.0**-10) if n > 1 else x[at]  # the smallest (a span a float64 sum holds)
        total, lo, hi = KERNEL.sum_stats(x)
        bits = x.view(np.uint32) & 0x7FFFFFFF
        assert (lo, hi) == ((int(bits.min()), int(bits.max())) if n else (0x7FFFFFFF, 0)), at
        assert total == math.fsum(x.astype(np.float64).tolist()), at  # (exact here: a float64 holds it)


# --- Golomb-Rice -------------------------------------------------------------------------------


def random_positions(rng: np.random.Generator, b: int) -> tuple[np.ndarray, int]:
    """Ascending unique positions whose gaps suit ``b`` (the unary section stays short)."""
    nnz = int(rng.integers(1, 400))
    gaps = rng.integers(1, 1 + min(2 ** min(b + 2, 40), 2**40), nnz)
    if rng.random() < 0.2:
        gaps[rng.integers(0, nnz)] += int(rng.integers(0, 5000))  # one long gap: a long unary run
    idx = np.cumsum(gaps) - 1
    numel = int(idx[-1]) + 1 + int(rng.integers(0, 3))
    return idx.astype(np.int64), numel


@needs_kernel
@pytest.mark.parametrize("b", range(golomb.MAX_B + 1))
def test_golomb_encode_and_decode_equal_numpy(b, monkeypatch):
    rng = np.random.default_rng(b)
    for trial in range(12):
        idx, numel = random_positions(rng, b)
        if trial == 0:
            idx = idx[:1]
        bits = golomb.encode_positions(torch.from_numpy(idx), b)
        assert bits == golomb._encode_positions_np(idx, b)
        if trial < 2 and idx.size < 40 and b <= 12:
            assert bits == ref.encode_positions(idx.tolist(), b)
        got = golomb.decode_positions(bits, idx.size, b, numel, "t")
        assert got.numpy().tobytes() == idx.tobytes()
    assert golomb.encode_positions(torch.zeros(0, dtype=torch.int64), b) == b""


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except PayloadError as e:
        return "error", str(e)


def hostile_streams(seed: int) -> list[tuple[bytes, int, int, int]]:
    """``(bits, nnz, b, numel)``: valid streams cut short, extended, with bits flipped, claiming
    other counts, sizes and parameters, and random bytes."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(40):
        b = int(rng.integers(0, 14)) if rng.random() < 0.8 else int(rng.integers(14, 63))
        idx, numel = random_positions(rng, b)
        bits = golomb._encode_positions_np(idx, b)
        nnz = idx.size
        out += [
            (bits[:-1], nnz, b, numel),
            (bits + b"\x00", nnz, b, numel),
            (bits + b"\x80", nnz, b, numel),
            (bits, nnz + 1, b, numel),
            (bits, max(1, nnz - 1), b, numel),
            (bits, nnz, b, max(nnz, numel - 1)),
            (bits, nnz, b, max(nnz, int(idx[-1]))),
            (bits, nnz, (b + 1) % 63, numel),
            (bits, nnz, max(0, b - 1), numel),
        ]
        flipped = bytearray(bits)
        for _ in range(3):
            at = int(rng.integers(0, len(bits)))
            flipped[at] ^= 1 << int(rng.integers(0, 8))
        out.append((bytes(flipped), nnz, b, numel))
        out.append((bytes(flipped[: len(flipped) // 2]), nnz, b, numel))
    for _ in range(60):
        numel = int(rng.integers(1, 3000))
        nnz = int(rng.integers(1, min(numel, 50) + 1))
        raw = rng.integers(0, 256, int(rng.integers(0, 60)), dtype=np.uint8).tobytes()
        out.append((raw, nnz, int(rng.integers(0, 63)), numel))
        out.append((b"\xff" * len(raw), nnz, int(rng.integers(0, 4)), numel))
    # overflowing quotients and cumulative sums (the NumPy decoder's own overflow cases)
    out.append((b"\x00" * 7 + b"\xfe", 1, 62, (1 << 62) - 1))
    out.append((b"\xff" * 8 + b"\x00", 2, 62, (1 << 62) - 1))
    out.append((bytes([0xFF] * 15 + [0xFE]), 1, 0, 100))
    return out


@needs_kernel
@pytest.mark.parametrize("seed", range(4))
def test_golomb_decoders_accept_and_reject_alike(seed, monkeypatch):
    """Positions or the PayloadError message: the kernel's as the NumPy path's."""
    for bits, nnz, b, numel in hostile_streams(seed):
        with_kernel = outcome(lambda *a: golomb.decode_positions(*a).tolist(), bits, nnz, b, numel, "w")
        monkeypatch.setattr(golomb, "_KERNEL", None)
        without = outcome(lambda *a: golomb.decode_positions(*a).tolist(), bits, nnz, b, numel, "w")
        monkeypatch.setattr(golomb, "_KERNEL", KERNEL)
        assert with_kernel == without, (bits, nnz, b, numel)


@needs_kernel
@pytest.mark.parametrize("n", [0, 1, 17, 1000, 65536, 65537, 200_003])
def test_dense_output_equals_numpy(n, monkeypatch):
    """The decoder's dense output (zeros, the mean at the positions), split among threads."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(sbc, "_PARALLEL_MIN", 1000)
    monkeypatch.setattr(sbc, "_CPU_CHUNK", 512)
    rng = np.random.default_rng(n)
    for density in (0.0, 0.001, 0.3, 1.0):
        idx = np.flatnonzero(rng.random(n) < density).astype(np.int64)
        for value in (1.25, -3e-41, -0.0):
            got = sbc._dense_cpu(idx, n, value)
            monkeypatch.setattr(sbc, "_KERNEL", None)
            want = sbc._dense_cpu(idx, n, value)
            monkeypatch.setattr(sbc, "_KERNEL", KERNEL)
            assert got.dtype == want.dtype == np.float32 and got.tobytes() == want.tobytes()


@needs_kernel
@pytest.mark.parametrize("shift", [0, 1, 2, 3])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 1.0])
def test_a_long_fill_at_any_alignment_equals_numpy(shift: int, density: float) -> None:
    """From 2**18 values on, ``fill`` asked to stream writes its aligned middle by non-temporal
    stores: every value as NumPy's, nothing outside [begin, end), at every alignment of the range."""
    assert KERNEL is not None
    rng = np.random.default_rng(shift)
    n, begin = (1 << 18) + 37, 5 + shift
    end = begin + n
    idx = np.flatnonzero(rng.random(n) < density).astype(np.int64) + begin
    idx = np.concatenate([[begin], idx[idx > begin]]) if density else idx  # (a position at begin too)
    out = np.full(end + 9, 7.0, dtype=np.float32)
    KERNEL.fill(out, begin, end, idx, 0, idx.shape[0], -2.5, True)
    want = np.full(end + 9, 7.0, dtype=np.float32)
    want[begin:end] = 0.0
    want[idx] = -2.5
    assert out.tobytes() == want.tobytes()


@needs_kernel
@pytest.mark.parametrize("where", [3, 1000, 150_000, (1 << 18) + 30])
def test_a_long_fill_refuses_positions_out_of_order_anywhere(where: int) -> None:
    assert KERNEL is not None
    n = (1 << 18) + 40
    idx = np.arange(0, n, 97, dtype=np.int64)
    k = min(int(np.searchsorted(idx, where)), idx.shape[0] - 1)
    bad = idx.copy()
    bad[k] = bad[k - 1]  # a repeat: not strictly ascending
    with pytest.raises(ValueError, match="ascend"):
        KERNEL.fill(np.empty(n, np.float32), 0, n, bad, 0, bad.shape[0], 1.0, True)
    past = np.append(idx, n)  # past the end
    with pytest.raises(ValueError, match="ascend"):
        KERNEL.fill(np.empty(n, np.float32), 0, n, past, 0, past.shape[0], 1.0, True)


@needs_kernel
def test_fill_checks_its_positions():
    assert KERNEL is not None
    out = np.empty(10, dtype=np.float32)
    for pos, p0, p1, begin, end in (
        ([2, 2], 0, 2, 0, 10),  # not strictly ascending
        ([5, 3], 0, 2, 0, 10),
        ([10], 0, 1, 0, 10),  # outside [begin, end)
        ([1], 0, 1, 2, 10),
        ([1], 0, 2, 0, 10),  # p1 past the positions
        ([1], 0, 1, 0, 11),  # end past the output
    ):
        with pytest.raises(ValueError):
            KERNEL.fill(out, begin, end, np.array(pos, dtype=np.int64), p0, p1, 1.0)


# --- the whole update ----------------------------------------------------------------------------


def resnet_like_update(seed: int) -> dict[str, torch.Tensor]:
    """A few tensors of the shapes that matter: large (threaded scan), mid-size, at the fast
    mode's sample size, below it (exact mode), and small (dense)."""
    rng = np.random.default_rng(seed)
    shapes = {"big": (1_100_000,), "conv": (64, 64, 3, 3), "at": (25_601,), "below": (20_000,), "bias": (64,)}
    out = {}
    for name, shape in shapes.items():
        x = rng.standard_t(3, shape) if seed % 2 else rng.standard_normal(shape)
        out[name] = torch.from_numpy(x.astype(np.float32))
    out["ties"] = torch.from_numpy((np.round(rng.standard_normal(300_000) * 2) / 2).astype(np.float32))
    zeros = np.where(rng.random(70_000) < 0.003, rng.standard_normal(70_000), 0.0)
    out["zeros"] = torch.from_numpy(zeros.astype(np.float32))
    return out


@needs_kernel
@pytest.mark.parametrize("mode", ["fast", "exact"])
@pytest.mark.parametrize("seed", [0, 1])
def test_whole_update_bytes_equal_with_the_kernel_on_and_off(mode, seed, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    update = resnet_like_update(seed)
    codec = get_codec({"id": "sbc", "p": 0.01, "mode": mode})

    def roundtrip() -> tuple[bytes, dict[str, torch.Tensor]]:
        data = serde.update_to_bytes(UpdateEncoder(codec, error_feedback=False).encode(update))
        return data, decode_update(serde.update_from_bytes(data), specs_of(update), [codec, DenseFP32()])

    data_k, dec_k = roundtrip()
    monkeypatch.setattr(sbc, "_KERNEL", None)
    monkeypatch.setattr(golomb, "_KERNEL", None)
    data_n, dec_n = roundtrip()
    assert data_k == data_n
    assert dec_k.keys() == dec_n.keys()
    assert all(torch.equal(dec_k[k], dec_n[k]) for k in dec_k)
