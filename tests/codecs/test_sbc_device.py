"""The whole-update SBC engine (``fedcomp.codecs.sbc_device``): the bytes of :meth:`SBC.encode`,
tensor by tensor, and a count of operators, syncs and copies that does not grow with the number
of tensors. It runs the same torch operators on any device, so the CPU checks what CUDA runs;
on a CUDA machine the last test compares the two devices."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp.codecs import SBC, TensorSpec, flat, sbc_device
from fedcomp.codecs.flat import count_device_work
from fedcomp.codecs.sbc_device import encode_update
from tests.codecs.test_sbc_many import SAMPLE, _f32, batched_kinds

CODECS = [
    SBC(0.01, "fast", sample_size=SAMPLE),
    SBC(0.1, "fast", sample_size=SAMPLE),
    SBC(0.5, "fast", sample_size=SAMPLE),
    SBC(0.02, "exact"),
    SBC(0.5, "exact"),
]


def _kinds(seed: int) -> list[tuple[str, torch.Tensor]]:
    items = list(batched_kinds(seed).items())
    g = np.random.default_rng(100 + seed)
    items += [
        ("one", _f32(np.array([-0.25]))),
        ("large", _f32(g.standard_t(3, 70_000) * 1e-3)),
        ("ties_above_sample", _f32(np.repeat(np.arange(-3.0, 4.0), 1_000))),  # fast falls back to exact
        ("zero_signs", _f32(np.where(g.random(5_000) < 0.5, -0.0, 0.0))),
    ]
    return items


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_engine_gives_encodes_bytes_and_what_the_receiver_decodes(codec: SBC) -> None:
    for seed in range(2):
        items = _kinds(seed)
        found = encode_update(codec, items)
        assert found is not None
        assert found.encoded == [codec.encode(t, n) for n, t in items]
        # kept / value: where the receiver decodes what, into the flat buffer
        at, want_kept, want_value = 0, [], []
        for name, t in items:
            recon = codec.decode(codec.encode(t, name), TensorSpec.of(name, t)).reshape(-1)
            nz = torch.nonzero(recon).reshape(-1).numpy()
            want_kept.append(nz + at)
            want_value.append(recon.numpy()[nz])
            at += t.numel()
        kept_nonzero = found.value != 0  # a kept position whose mean is 0 decodes as 0
        assert np.array_equal(found.kept[kept_nonzero], np.concatenate(want_kept))
        assert np.array_equal(found.value[kept_nonzero], np.concatenate(want_value))
        assert np.all(np.diff(found.kept) > 0)


@pytest.mark.parametrize("codec", CODECS[:3], ids=repr)
def test_hits_past_int32_travel_as_int64_with_the_same_bytes(codec: SBC, monkeypatch) -> None:
    items = _kinds(4)
    with count_device_work() as packed:
        want = encode_update(codec, items)
    monkeypatch.setattr(flat, "_INT32_POSITIONS", 0)  # as an update of over 2**31 values
    with count_device_work() as work:
        got = encode_update(codec, items)
    assert got is not None and want is not None
    assert got.encoded == want.encoded == [codec.encode(t, n) for n, t in items]
    assert np.array_equal(got.kept, want.kept) and np.array_equal(got.value, want.value)
    assert work.to_host == 2 * packed.to_host  # positions and values in two copies, not one


def _candidates(g: np.random.Generator, n: int, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    pos = np.sort(g.choice(n, size=min(n, 40), replace=False)).astype(np.int64)
    half = pos.shape[0] // 2
    hi, lo = pos[:half], pos[half:]
    if kind == "tie":  # equal mean magnitudes: the positive side, as choose_side
        hv, lv = np.full(hi.shape[0], 0.5, np.float32), np.full(lo.shape[0], -0.5, np.float32)
    elif kind == "wide":  # exponents too far apart for a float64 sum: left to choose_side
        hv = np.array([1e30] + [1e-30] * (hi.shape[0] - 1), np.float32)
        lv = -np.abs(g.standard_normal(lo.shape[0]).astype(np.float32))
    elif kind == "nan":
        hv = g.standard_normal(hi.shape[0]).astype(np.float32)
        hv[0] = np.nan
        lv = -np.abs(g.standard_normal(lo.shape[0]).astype(np.float32))
    else:
        scale = np.float32(2.0 ** g.integers(-40, 20))
        hv = (np.abs(g.standard_normal(hi.shape[0])) * scale).astype(np.float32)
        lv = (-np.abs(g.standard_normal(lo.shape[0])) * scale).astype(np.float32)
        if kind == "zeros":
            hv[::2] = 0.0
    return hi, hv, lo, lv


def _laid_out(cands: list, numels: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-tensor candidates as ``choose_sides_flat`` takes them: flat positions (the tensors back to
    back, in a shuffled order of sides), values, ranges and bases."""
    bases = np.concatenate(([0], np.cumsum(numels)[:-1])).astype(np.int64)
    pieces = [(i, side) for i in range(len(cands)) for side in (0, 1)]
    np.random.default_rng(3).shuffle(pieces)  # the ranges, not the order, say where a side lies
    positions, values, ranges, at = [], [], np.zeros((len(cands), 4), np.int64), 0
    for i, side in pieces:
        pos, val = cands[i][2 * side], cands[i][2 * side + 1]
        positions.append(pos + bases[i])
        values.append(val)
        ranges[i, 2 * side : 2 * side + 2] = (at, at + pos.shape[0])
        at += pos.shape[0]
    return np.concatenate(positions), np.concatenate(values), ranges, bases


@pytest.mark.parametrize("width", [np.int64, np.int32])
def test_choose_sides_flat_is_choose_side_and_the_golomb_code(width: type) -> None:
    """Positions in int64, or in int32 as a device copies them where they fit: the kept positions
    come back in the same width."""
    from fedcomp.codecs.golomb import encode_positions, golomb_b
    from fedcomp.codecs.sbc import choose_side, choose_sides_flat

    g = np.random.default_rng(11)
    for kinds in (["plain", "tie", "zeros"] * 8, ["plain", "tie", "zeros", "wide", "nan"] * 8):
        numels = [int(g.integers(40, 100_000)) for _ in kinds]
        cands = [_candidates(g, n, kind) for n, kind in zip(numels, kinds, strict=True)]
        positions, values, ranges, bases = _laid_out(cands, numels)
        found = choose_sides_flat(positions.astype(width), values, ranges, bases, np.array(numels, np.int64))
        kept, value = [], []
        for kind, n, c, res, base in zip(kinds, numels, cands, found.sides, bases, strict=True):
            want = choose_side(*c)
            if kind in ("wide", "nan"):
                assert res is None, kind  # the caller's choose_side says what (None for a NaN)
                continue
            assert res is not None and want is not None, kind
            mean, nnz, b, bits, positive = res
            assert np.array_equal(c[0] if positive else c[2], want[0]) and mean == want[1], kind
            assert nnz == want[0].shape[0] and b == golomb_b(nnz / n)
            assert bits == encode_positions(torch.from_numpy(want[0]), b)
            kept.append(want[0] + base)
            value.append(np.full(nnz, mean, np.float32))
        if "wide" in kinds:
            assert found.kept is None and found.value is None  # some tensor was left to Python
        else:
            assert found.kept is not None and found.value is not None
            assert found.kept.dtype == width
            assert np.array_equal(found.kept, np.concatenate(kept))
            assert np.array_equal(found.value, np.concatenate(value))
    empty = choose_sides_flat(
        np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros((0, 4), np.int64), *[np.zeros(0, np.int64)] * 2
    )
    assert empty.sides == []


@given(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True), min_size=1, max_size=40),
    st.integers(0, 30),
)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_kernels_mean_is_the_exact_mean_rounded_to_float32(vals: list[float], scale: int) -> None:
    """``sides_flat``'s mean (C, 128-bit integers) against ``_round_f32`` of the exact sum (Python
    integers), subnormal means included: one tensor whose high side is ``vals`` (as magnitudes)
    and whose low side is one zero, so the high side is kept."""
    from fedcomp.codecs.sbc import _exact_sum, _round_f32, choose_sides_flat

    hv = np.abs(np.array(vals, np.float32)) * np.float32(2.0**-scale)
    if not np.all(np.isfinite(hv)) or hv.sum() == 0:
        return
    n = 2 * hv.shape[0] + 2
    positions = np.concatenate([np.arange(hv.shape[0]), [n - 1]]).astype(np.int64)
    values = np.concatenate([hv, np.zeros(1, np.float32)])  # mean 0: the high side is kept, a tie too
    ranges = np.array([[0, hv.shape[0], hv.shape[0], hv.shape[0] + 1]], np.int64)
    found = choose_sides_flat(positions, values, ranges, np.zeros(1, np.int64), np.array([n], np.int64))
    side = found.sides[0]
    total = _exact_sum(hv)
    if side is None:  # sums a float64 cannot hold exactly: left to Python
        return
    assert total is not None
    assert side[4] and side[0] == _round_f32(total, hv.shape[0] << 149)


def test_without_the_kernel_the_engine_chooses_in_python(monkeypatch) -> None:
    from fedcomp.codecs import sbc

    codec = SBC(0.02, "fast", sample_size=SAMPLE)
    items = _kinds(5)
    monkeypatch.setattr(sbc, "_KERNEL", None)
    one = [_candidates(np.random.default_rng(0), 100, "plain")]
    found = sbc.choose_sides_flat(*_laid_out(one, [100]), np.array([100], np.int64))
    assert found.sides == [None] and found.kept is None
    found = encode_update(codec, items)
    assert found is not None and found.encoded == [codec.encode(t, n) for n, t in items]


def test_exact_rows_in_many_chunks_give_the_same_bytes(monkeypatch) -> None:
    codec = SBC(0.05, "exact")
    items = _kinds(3)
    want = encode_update(codec, items)
    monkeypatch.setattr(sbc_device, "_EXACT_BUDGET", 4_096)  # about a chunk per tensor
    sbc_device._exact_layout.cache_clear()  # (the chunks are kept by layout)
    with count_device_work() as work:
        got = encode_update(codec, items)
    sbc_device._exact_layout.cache_clear()
    assert got is not None and want is not None
    assert got.encoded == want.encoded
    assert work.by_op["aten.sort"] > 4 * 4  # (it did split: two sorts per side per chunk)


def test_work_does_not_grow_with_the_number_of_tensors() -> None:
    codec = SBC(0.01, "fast", sample_size=SAMPLE)
    g = np.random.default_rng(5)
    pool = [(f"t{i}", _f32(g.standard_t(3, int(g.integers(SAMPLE + 1, 9_000))))) for i in range(64)]
    pool += [(f"s{i}", _f32(g.standard_t(3, int(g.integers(50, SAMPLE))))) for i in range(64)]
    counts = []
    for many in (4, 16, 64):
        items = pool[:many] + pool[64 : 64 + many]
        encode_update(codec, items)  # (the plan: sample positions and sizes, kept per layout)
        with count_device_work() as work:
            found = encode_update(codec, items)
        assert found is not None and found.encoded == [codec.encode(t, n) for n, t in items]
        counts.append((work.ops, work.syncs, work.to_host, work.to_device))
    assert counts[0] == counts[1] == counts[2], counts
    ops, syncs, to_host, to_device = counts[0]
    # One fast pass and one exact chunk: about thirty operators (each a launch, and on a GPU host
    # tens of microseconds of its time: 61 before the sides of exact mode were sorted together,
    # the thresholds set by one scatter and the copy's parts cast together), the waits of the copy
    # and nonzero; no copy to the device once the plan is kept.
    assert ops <= 30 and syncs <= 2 and to_host <= 1 and to_device <= 1, counts[0]


@pytest.mark.parametrize("capacity", [0, 1, 7, None])
def test_hits_past_the_block_are_found_again_with_a_wait(capacity: int | None, monkeypatch) -> None:
    """Fast mode's hits come in a block of fixed size, with no wait for the device; where the
    block fills up (perhaps more hits than it holds) they are found again by ``nonzero``: the
    same bytes either way."""
    codec = SBC(0.01, "fast", sample_size=SAMPLE)
    items = _kinds(3)
    real = sbc_device._plan
    want = [codec.encode(t, n) for n, t in items]
    encode_update(codec, items)  # (the plan, kept)
    with count_device_work() as own:
        encode_update(codec, items)
    if capacity is not None:  # (None: the plan's own, which holds them)
        monkeypatch.setattr(sbc_device, "_plan", lambda *a: dataclasses.replace(real(*a), capacity=capacity))
    with count_device_work() as work:
        found = encode_update(codec, items)
    assert found is not None and found.encoded == want
    more = (0, 0) if capacity is None else (1, 2)  # a copy of the block, and nonzero's wait
    assert (work.to_host, work.syncs) == (own.to_host + more[0], own.syncs + more[1]), work


def test_without_nonzero_static_the_hits_are_found_by_nonzero(monkeypatch) -> None:
    """A torch without ``nonzero_static`` on the device (2.4 on CUDA) finds fast mode's hits by
    ``nonzero``: the same bytes, one wait more."""
    assert sbc_device.has_nonzero_static("cpu")  # (torch >= 2.4: on the CPU)
    codec = SBC(0.01, "fast", sample_size=SAMPLE)
    items = _kinds(4)
    encode_update(codec, items)  # (the plan, kept)
    with count_device_work() as own:
        found = encode_update(codec, items)
    monkeypatch.setattr(sbc_device, "has_nonzero_static", lambda device_type: False)
    with count_device_work() as work:
        again = encode_update(codec, items)
    assert found is not None and again is not None and again.encoded == found.encoded
    assert again.encoded == [codec.encode(t, n) for n, t in items]
    assert (work.to_host, work.syncs, work.by_op.get("aten.nonzero")) == (own.to_host, own.syncs + 1, 1), work


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("codec", [SBC(0.01, "fast", sample_size=SAMPLE), SBC(0.1, "exact")], ids=repr)
def test_a_value_that_is_not_finite_anywhere_leaves_the_update_to_encode(codec: SBC, value: float) -> None:
    # (encode then raises naming the tensor, or, for a NaN that fast mode neither samples nor
    # selects, encodes without it: its own behaviour either way)
    items = _kinds(0)
    name, t = items[1]
    bad = t.clone().reshape(-1)
    bad[7] = value
    items[1] = (name, bad.view(t.shape))
    assert encode_update(codec, items) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the CPU runs the same operators above)")
def test_cuda_gives_the_cpu_bytes() -> None:
    for codec in CODECS:
        items = _kinds(1)
        on_gpu = [(n, t.cuda()) for n, t in items]
        found = encode_update(codec, on_gpu)
        assert found is not None
        assert found.encoded == [codec.encode(t, n) for n, t in items]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 4_000), min_size=1, max_size=6),
    p=st.sampled_from([0.001, 0.01, 0.1, 0.5]) | st.floats(0.0005, 0.5),
    mode=st.sampled_from(["fast", "exact"]),
    levels=st.sampled_from([0, 3, 7]),  # 0: continuous values; else few levels (ties everywhere)
    seed=st.integers(0, 2**31),
)
def test_any_layout_gives_encodes_bytes(sizes, p, mode, levels, seed) -> None:
    g = np.random.default_rng(seed)
    codec = SBC(p, mode, sample_size=max(2, min(SAMPLE, round(64 / p))))
    items = []
    for i, n in enumerate(sizes):
        values = g.standard_t(2, n) if not levels else g.integers(-levels, levels + 1, n) * 0.25
        items.append((f"t{i}", _f32(values * 2.0 ** int(g.integers(-30, 30)))))
    found = encode_update(codec, items)
    assert found is not None
    assert found.encoded == [codec.encode(t, n) for n, t in items]


@pytest.mark.parametrize("codec", CODECS[:2], ids=repr)
def test_a_frozen_layer_is_not_copied_to_the_host_as_candidates(codec: SBC, monkeypatch) -> None:
    """An all-zero tensor (a frozen layer) meets fast mode's thresholds at zero: every value would
    be a hit on both sides, all copied to the host before the fallback to exact mode. The engine
    finds none there (fast mode fails on such a tensor whatever the scan finds) and exact mode
    takes it: the same bytes (no positions, mean 0), and a first copy of the other tensors' hits."""
    g = np.random.default_rng(3)
    items = [
        ("frozen", torch.zeros(200_000)),
        ("trained", _f32(g.standard_t(3, 100_000))),
        ("frozen_signs", _f32(np.where(g.random(80_000) < 0.5, -0.0, 0.0))),
        ("tiny", _f32(g.standard_normal(50))),  # exact mode
    ]
    copied: list[int] = []
    real = sbc_device._for_host

    def spy(hits, exact, *args, **kwargs):  # type: ignore[no-untyped-def]
        copied.append(0 if hits is None else int(hits.counts[1]))  # (the hits in the block copied)
        return real(hits, exact, *args, **kwargs)

    monkeypatch.setattr(sbc_device, "_for_host", spy)
    found = encode_update(codec, items)
    assert found is not None
    assert found.encoded == [codec.encode(t, n) for n, t in items]
    assert [e.payload.nnz for e in found.encoded[:3:2]] == [0, 0]
    k = round(codec.p * 100_000)
    assert len(copied) == 2 and 0 < copied[0] <= 4 * k  # the trained tensor's hits only; then exact mode
