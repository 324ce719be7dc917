import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp.codecs import TensorSpec, get_codec
from fedcomp.codecs.golomb import encode_positions, golomb_b
from fedcomp.codecs.sbc import (
    SBC,
    _exact_sum,
    _extreme_positions_cpu,
    _extreme_positions_torch,
    _round_f32,
    _sample_positions,
    _threshold_select_cpu,
    _threshold_select_torch,
)
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.wire import serde
from fedcomp.wire.payloads import DensePayload, EncodedTensor, SBCPayload
from tests.codecs import kit
from tests.codecs import reference_sbc as ref

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def seeded(n, seed=0, kind="normal"):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "student":
        # student-t (df 3): heavy tails, like accumulated weight updates
        z = torch.randn(n, generator=g, dtype=torch.float64)
        chi2 = (torch.randn(n, 3, generator=g, dtype=torch.float64) ** 2).sum(1)
        return (z / torch.sqrt(chi2 / 3)).to(torch.float32)
    raise ValueError(kind)


# --- exact mode against the reference ---------------------------------------------------------


KINDS = ["normal", "ties", "zeros", "negative", "wide", "subnormal", "const"]


def make_tensor(kind: str, n: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        a = rng.standard_normal(n)
    elif kind == "ties":  # few distinct values: ties across the selection boundary
        a = rng.integers(-3, 4, n).astype(np.float64) * 0.25
    elif kind == "zeros":  # mostly zeros, some of them negative zeros
        a = np.where(rng.random(n) < 0.9, 0.0, rng.standard_normal(n))
        a = np.where(rng.random(n) < 0.5, -a, a)
    elif kind == "negative":  # the negative side should win
        a = -np.abs(rng.standard_normal(n)) * 3 + rng.random(n)
    elif kind == "wide":  # exponents far apart: the exact sum needs per-exponent bins
        a = rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)
    elif kind == "subnormal":  # means that round into the subnormal range
        a = rng.integers(-5, 6, n) * 2.0**-149
    else:
        a = np.full(n, rng.standard_normal())
    return torch.from_numpy(a.astype(np.float32))


@st.composite
def small_tensors(draw, min_size=0):
    n = draw(st.integers(min_size, 2000))
    x = make_tensor(draw(st.sampled_from(KINDS)), n, draw(st.integers(0, 2**32 - 1)))
    p = draw(st.sampled_from([0.001, 0.01, 0.1, 0.25, 0.5]) | st.floats(0.0005, 0.5))
    return x, p


def check_against_reference(x: torch.Tensor, p: float) -> None:
    enc = SBC(p=p, mode="exact").encode(x, "t")
    mean, b, nnz, bits = ref.sbc_exact([float(v) for v in x.tolist()], p)
    payload = enc.payload
    assert isinstance(payload, SBCPayload)
    assert (payload.nnz, payload.golomb_b, payload.bits) == (nnz, b, bits)
    assert payload.mean == mean and math.copysign(1, payload.mean) == math.copysign(1, mean)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, p", [(1999, 0.01), (2000, 0.5), (2000, 0.001), (40_000, 0.01)])
def test_exact_mode_matches_reference_on_larger_tensors(kind, n, p):
    # every kind at every size (the reference takes ~0.3 s at 40,000): at n = 40,000 "wide"
    # sums 400 values over many exponents (the per-exponent bins), "subnormal" rounds a mean
    # into the subnormal range, "const" ties every value, "negative" picks the negative side
    check_against_reference(make_tensor(kind, n, n), p)


@given(small_tensors())
@FAST
def test_exact_mode_matches_reference(case):
    check_against_reference(*case)


@given(small_tensors())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fast_mode_on_small_tensors_is_exact(case):
    x, p = case  # at most sample_size elements: fast mode is exact mode
    assert SBC(p, "fast", sample_size=2000).encode(x, "t") == SBC(p, "exact").encode(x, "t")


def test_fast_mode_samples_only_tensors_larger_than_the_sample():
    ties = (torch.arange(64) % 5 - 2).float()  # a threshold pass would keep all of a tied value
    exact = SBC(0.25, "exact").encode(ties, "t")
    assert SBC(0.25, "fast", sample_size=64).encode(ties, "t") == exact  # n == sample_size
    assert exact.payload.nnz == 16
    assert SBC(0.25, "fast", sample_size=63).encode(ties, "t").payload.nnz == 26  # sampled: 2, 1 kept


@given(small_tensors(min_size=2), st.integers(1, 1999))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fast_mode_matches_reference(case, sample_size):
    """Tensors larger than the sample: thresholds from the sample, a pass over the tensor, the
    exact-mode fallback, byte for byte as the plain-Python reference says."""
    x, p = case
    check_fast_against_reference(x, p, min(sample_size, x.numel() - 1))


@pytest.mark.parametrize(
    "kind, n, p, sample_size",
    [
        ("normal", 5000, 0.01, 500),  # r = 5 of 500: the two partitions of the sample
        ("normal", 20000, 0.001, 600),  # r = 1: the sample's minimum and maximum
        ("student", 5000, 0.01, 2000),
        ("normal", 3000, 0.5, 3),  # 2 r > s: the sample is sorted
        ("normal", 50, 0.25, 2),  # the smallest sample that is partitioned
        ("normal", 50, 0.01, 1),
        ("negative", 4000, 0.05, 300),
    ],
)
def test_fast_mode_matches_reference_at_fixed_sizes(kind, n, p, sample_size):
    x = seeded(n, 7, kind) if kind in ("normal", "student") else make_tensor(kind, n, 7)
    check_fast_against_reference(x, p, sample_size)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_fast_mode_side_size_limits(sign):
    """A side of one entry is kept; a side of more than 2 k (here 2.5 k, ties) means exact mode."""
    n, s = 1000, 100  # p = 0.01: k = 10 and r = 1, the thresholds are the sample's extremes
    at = _sample_positions(n, s, "cpu").tolist()
    x = seeded(n, 3) * 0.1
    x[at[10]], x[at[20]] = -5.0 * sign, 3.0 * sign  # each side: one entry, at its threshold
    one = SBC(0.01, "fast", sample_size=s).encode(x, "t").payload
    assert (one.nnz, one.mean) == (1, -5.0 * sign)
    y = torch.zeros(n)
    y[:25], y[500:515] = sign, -2.0 * sign  # 25 ties at one threshold, 15 at the other
    many = SBC(0.01, "fast", sample_size=900).encode(y, "t")
    assert many == SBC(0.01, "exact").encode(y, "t") and many.payload.nnz == 10
    for case in ((x, 0.01, s), (y, 0.01, 900)):
        check_fast_against_reference(*case)


def test_encode_names_the_tensor():
    assert SBC().encode(seeded(10)).name == ""  # the default name
    with pytest.raises(TypeError, match="'w'"):
        SBC().encode(torch.zeros(3, dtype=torch.int32), "w")


def check_fast_against_reference(x, p, sample_size):
    n = x.numel()
    enc = SBC(p, "fast", sample_size=sample_size).encode(x, "t")
    sample = _sample_positions(n, sample_size, "cpu").tolist()
    mean, b, nnz, bits = ref.sbc_fast([float(v) for v in x.tolist()], p, sample)
    payload = enc.payload
    assert (payload.nnz, payload.golomb_b, payload.bits) == (nnz, b, bits)
    assert payload.mean == mean and math.copysign(1, payload.mean) == math.copysign(1, mean)


@given(st.integers(-(2**64), 2**64), st.integers(1, 2**64), st.integers(-220, 60))
@FAST
def test_round_f32_is_correctly_rounded(num, den, exp):
    # num / den * 2**exp stays below 2**125, inside float32's range, and reaches below subnormals
    x = Fraction(num, den) * Fraction(2) ** exp
    assert _round_f32(x.numerator, x.denominator) == ref.round_to_float32(x)


def test_round_f32_ties_and_subnormals():
    assert _round_f32(1, 3) == float(np.float32(1 / 3))
    assert _round_f32(2**24 + 1, 1) == 2.0**24  # tie to even
    assert _round_f32(2**24 + 3, 1) == 2.0**24 + 4
    assert _round_f32(1, 2**150) == 0.0  # half the smallest subnormal: ties to even (zero)
    assert _round_f32(3, 2**150) == 2.0**-148
    assert _round_f32(-7, 2**149) == -7 * 2.0**-149


@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=300))
@FAST
def test_exact_sum_is_exact(values):
    a = np.array(values, dtype=np.float32)
    assert Fraction(_exact_sum(a), 2**149) == sum((Fraction(float(v)) for v in a), Fraction(0))


def test_exact_sum_paths():
    narrow = np.float32([1.5, -2.25, 3.0, 1e-3])  # float64 path
    wide = np.float32([3e38, 1e-45, -3e38, 2.0**-126, 1.0])  # per-exponent bins
    for a in (narrow, wide):
        assert Fraction(_exact_sum(a), 2**149) == sum(Fraction(float(v)) for v in a)
    assert _exact_sum(np.float32([1.0, np.inf])) is None
    assert _exact_sum(np.float32([np.nan])) is None
    assert _exact_sum(np.float32([])) == 0


@given(small_tensors(min_size=1))  # k >= 1 selects from a non-empty tensor; SBC never calls them on none
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_device_generic_selection_matches_cpu_selection(case):
    """The torch code CUDA runs, run on CPU, selects exactly what the NumPy CPU code selects."""
    x, p = case
    n = x.numel()
    k = max(1, round(p * n))
    hi, lo = _extreme_positions_cpu(x.numpy(), k)
    assert _extreme_positions_torch(x, k, largest=True).tolist() == hi.tolist()
    assert _extreme_positions_torch(x, k, largest=False).tolist() == lo.tolist()
    thr_hi, thr_lo = np.float32(x.max()), np.float32(x.median())
    a = _threshold_select_cpu(x.numpy(), thr_hi, thr_lo, limit=2 * n)
    b = _threshold_select_torch(x, thr_hi, thr_lo, limit=2 * n)
    assert a is not None and b is not None
    for u, v in zip(a, b):
        assert np.asarray(u).tolist() == (v.tolist() if isinstance(v, torch.Tensor) else v.tolist())
    assert _threshold_select_cpu(x.numpy(), thr_hi, thr_lo, limit=0) is None
    assert _threshold_select_torch(x, thr_hi, thr_lo, limit=0) is None


def lowest_index_extremes(values, k, largest):
    """The k largest (smallest) values' positions, ties to the lowest index, ascending: a sort."""
    sign = -1 if largest else 1
    return sorted(sorted(range(len(values)), key=lambda i: (sign * values[i], i))[:k])


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize(
    "values, k",
    [
        ([7.0], 1),  # k >= n
        ([1.0, 2.0], 1),  # k = n - 1: the torch version asks topk for all n
        ([2.0, 1.0, 2.0], 2),
        ([0.0, 0.0, 0.0, 0.0, 5.0], 2),  # a tie at the boundary, below a distinct top value
        ([3.0, 2.0, 1.0, 1.0, 0.0], 3),  # a tie of two straddling the boundary, distinct above it
        ([0.0] * 99 + [5.0], 10),  # topk returns tied positions in no particular order
        ([4.0, 4.0, 4.0, 1.0, 4.0, 4.0], 4),
    ],
)
def test_extreme_positions_at_the_boundary(values, k, largest):
    x = torch.tensor(values if largest else [-v for v in values])
    want = lowest_index_extremes(x.tolist(), k, largest)
    assert _extreme_positions_torch(x, k, largest=largest).tolist() == want
    hi, lo = _extreme_positions_cpu(x.numpy(), k)
    assert (hi if largest else lo).tolist() == want
    assert (lo if largest else hi).tolist() == lowest_index_extremes(x.tolist(), k, not largest)


# --- round trips, devices, special tensors ----------------------------------------------------

CODECS = [SBC(0.01, "exact"), SBC(0.01, "fast"), SBC(0.001, "fast"), SBC(0.5, "exact")]
TENSORS = {
    "normal-4096": lambda: seeded(4096),
    "student-3x300x700": lambda: seeded(630_000, 3, "student").reshape(3, 300, 700),
    "zeros": lambda: torch.zeros(50, 20),
    "empty": lambda: torch.zeros(0, 5),
    "scalar": lambda: torch.tensor(-2.5),
    "one": lambda: torch.ones(1),
    "negative": lambda: -seeded(5000).abs() * 4,
    "mostly-zero-1M": lambda: torch.where(seeded(1_000_000, 4) > 2.5, 1.0, 0.0),
}


@pytest.mark.parametrize("device", kit.devices())
@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("tensor", list(TENSORS))
def test_round_trip(codec, tensor, device):
    x = TENSORS[tensor]().to(device)
    dec, _ = kit.round_trip(codec, x)
    n = x.numel()
    nz = dec.reshape(-1)[dec.reshape(-1) != 0]
    if n:
        assert nz.numel() <= max(1, 2 * round(codec.p * n))
        assert torch.unique(nz).numel() <= 1  # binary: one value
    if tensor == "zeros":
        assert not bool(dec.any())
    if tensor == "negative" and n:
        assert float(nz[0]) < 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes(dtype):
    x = seeded(3000, 5).to(dtype)
    dec, _ = kit.round_trip(SBC(0.05), x)
    assert dec.dtype == dtype


def test_selection_semantics():
    x = torch.tensor([0.0, 5.0, -1.0, 4.0, -9.0, 3.0, -8.0, 0.0, 2.0, 1.0])
    # p = 0.2 -> k = 2: positive side {5, 4} mean 4.5, negative side {-9, -8} mean -8.5 -> negative
    enc = SBC(0.2, "exact").encode(x, "t")
    dec = SBC(0.2, "exact").decode(enc, TensorSpec.of("t", x))
    assert dec.tolist() == [0, 0, 0, 0, -8.5, 0, -8.5, 0, 0, 0]
    # equal means keep the positive side; ties go to the lowest indices
    y = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    enc = SBC(0.34, "exact").encode(y, "t")  # k = round(2.04) = 2
    assert SBC(0.34).decode(enc, TensorSpec.of("t", y)).tolist() == [1, 0, 1, 0, 0, 0]


def test_reconstruction_is_cheap_and_exact():
    x = seeded(200_000, 9, "student")
    codec = SBC(0.01)
    enc, recon = codec.encode_with_reconstruction(x, "t")
    assert torch.equal(recon, codec.decode(enc, TensorSpec.of("t", x)))
    assert enc.payload.golomb_b == golomb_b(enc.payload.nnz / x.numel())


@pytest.mark.parametrize("tensor", ["normal-4096", "student-3x300x700", "zeros", "empty", "scalar"])
def test_encode_skips_reconstruction_but_gives_the_same_message(tensor):
    x = TENSORS[tensor]()
    for codec in CODECS:
        assert codec.encode(x, "w") == codec.encode_with_reconstruction(x, "w")[0]
    with pytest.raises(TypeError):
        SBC().encode(torch.zeros(3, dtype=torch.int32), "w")


def test_threaded_scan_does_not_change_the_result():
    x = seeded(1_500_000, 12, "student")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = SBC(0.01).encode(x, "t")
        torch.set_num_threads(3)
        three = SBC(0.01).encode(x, "t")
    finally:
        torch.set_num_threads(before)
    assert one == three


@pytest.mark.parametrize("threads", [1, 3])
def test_threshold_pass_in_chunks_and_parts(monkeypatch, threads):
    """The CPU threshold pass, with chunks of 7 elements and parts of >= 16 (so a 100-element
    tensor takes several of each): the positions and values of a plain NumPy compare, and None
    exactly when the two sides hold more than ``limit`` entries together."""
    import fedcomp.codecs.sbc as sbc

    monkeypatch.setattr(sbc, "_CPU_CHUNK", 7)
    monkeypatch.setattr(sbc, "_PARALLEL_MIN", 16)
    a = make_tensor("ties", 100, 5).numpy()  # values -0.75 .. 0.75 in steps of 0.25
    thr_hi, thr_lo = np.float32(0.5), np.float32(-0.5)
    hi, lo = np.flatnonzero(a >= thr_hi), np.flatnonzero(a <= thr_lo)
    total = hi.size + lo.size
    assert 0 < hi.size < 50 and 0 < lo.size < 50
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = _threshold_select_cpu(a, thr_hi, thr_lo, limit=total)
        assert got is not None
        for out, want in zip(got, (hi, a[hi], lo, a[lo])):
            assert out.tolist() == want.tolist()
        assert _threshold_select_cpu(a, thr_hi, thr_lo, limit=total - 1) is None
    finally:
        torch.set_num_threads(before)
    # one part of the tensor: positions are absolute, and only that part is looked at
    part = sbc._scan(a, 13, 61, thr_hi, thr_lo, limit=total)
    assert part is not None
    assert part[0].tolist() == [i for i in hi.tolist() if 13 <= i < 61]
    assert part[1].tolist() == [i for i in lo.tolist() if 13 <= i < 61]
    inside = len(part[0]) + len(part[1])
    assert sbc._scan(a, 13, 61, thr_hi, thr_lo, limit=inside - 1) is None
    empty = sbc._scan(a, 40, 40, thr_hi, thr_lo, limit=0)  # an empty part: int64 positions, joined with the others
    assert empty is not None and [(x.tolist(), x.dtype) for x in empty] == [([], np.int64), ([], np.int64)]


def test_scan_pool_is_built_once_per_process(monkeypatch):
    import fedcomp.codecs.sbc as sbc

    monkeypatch.setattr(sbc, "_POOL", None)  # restored afterwards
    pool = sbc._pool()
    assert sbc._pool() is pool  # reused within a process
    assert pool._max_workers == sbc._MAX_WORKERS - 1  # the calling thread scans the first part
    assert pool._thread_name_prefix == "fedcomp-sbc"  # how its threads show in py-spy / gdb
    monkeypatch.setattr(sbc.os, "getpid", lambda: -1)  # as in a forked child: no pool threads there
    child = sbc._pool()
    assert child is not pool and sbc._pool() is child


def test_pool_threads_run_torch_operators_alone_and_leave_the_callers_threads_be(monkeypatch):
    # A pool thread with an OpenMP team of its own made libgomp stop every idle worker spinning
    # (more OpenMP threads than cores): each small operator of the main thread then waited for
    # its workers to wake, several times slower (sbc.serial_torch_thread).
    import fedcomp.codecs.sbc as sbc

    if torch.get_num_threads() < 2:
        pytest.skip("torch runs on one thread here: nothing to keep apart")
    # A pool of its own: threads another test started while it stood in for torch.get_num_threads
    # (tests/native) were set up by the stand-in, not by torch (this test failed after those).
    monkeypatch.setattr(sbc, "_POOL", None)
    before = torch.get_num_threads()

    def job() -> tuple[int, float]:
        return torch.get_num_threads(), float(torch.ones(1 << 20).double().sum())  # a parallel operator

    results = [f.result() for f in [sbc._pool().submit(job) for _ in range(2 * sbc._MAX_WORKERS)]]
    assert results == [(1, float(1 << 20))] * len(results)
    assert torch.get_num_threads() == before  # the caller's own setting is untouched


def test_non_finite_input_is_rejected():
    for mode in ("exact", "fast"):
        for bad in (math.nan, math.inf, -math.inf):
            x = seeded(100_000, 1)
            x[12345] = bad
            if mode == "fast" and math.isnan(bad):
                x[_sample_positions(100_000, SBC(0.01).sample_size, "cpu")[7]] = bad  # sampled
            with pytest.raises(ValueError, match="'w'"):
                SBC(0.01, mode).encode(x, "w")
            with pytest.raises(ValueError, match="'w'"):  # what error feedback calls
                SBC(0.01, mode).encode_with_reconstruction(x, "w")


@pytest.mark.parametrize("where", [0, 12_345, 999_999], ids=lambda w: f"at-{w}")
@pytest.mark.parametrize("path", ["native-one-part", "native-parts", "numpy", "torch"])
def test_fast_mode_names_a_nan_outside_its_sample(monkeypatch, path: str, where: int) -> None:
    """A NaN is neither above nor below the thresholds: fast mode's scan used to pass it by, the
    encode went through and the NaN stayed in the residual for good. Every scan now notes it,
    and exact mode (which fast mode falls back to) names the tensor. For SBC and STC alike."""
    from fedcomp.codecs import STC
    from fedcomp.codecs import sbc as sbc_module

    x = seeded(1_000_000, 4)
    sampled = set(_sample_positions(1_000_000, SBC(0.01).sample_size, "cpu").tolist())
    assert where not in sampled
    x[where] = math.nan
    if path == "native-parts":
        monkeypatch.setattr(sbc_module, "_split_parts", lambda n, per=0: 2)
    elif path == "numpy":
        monkeypatch.setattr(sbc_module, "_KERNEL", None)
    if path == "torch":  # (the scan of other devices, run here on the CPU)
        scan = sbc_module._threshold_select_torch
        assert scan(x, np.float32(2.5), np.float32(-2.5), 400_000) is None
        assert scan(x.nan_to_num(), np.float32(2.5), np.float32(-2.5), 400_000) is not None
        return
    for codec in (SBC(0.01), STC(0.01)):
        with pytest.raises(ValueError, match=r"'w'.*cannot encode NaN or infinite"):
            codec.encode(x, "w")


def test_sample_positions():
    pos = _sample_positions(1_000_003, 25_600, "cpu")
    assert pos.dtype == torch.int64 and pos.numel() == 25_600
    assert int(pos[0]) >= 0 and int(pos[-1]) < 1_000_003
    assert bool((pos[1:] > pos[:-1]).all())  # one per stratum
    # pinned: the sample is part of the wire format of fast mode
    assert pos[:4].tolist() == [21, 67, 81, 152]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_cuda_and_cpu_give_identical_bytes(codec):
    for name, make in TENSORS.items():
        x = make()
        cpu = serde.tensor_to_bytes(codec.encode(x, name))
        gpu = serde.tensor_to_bytes(codec.encode(x.cuda(), name))
        assert cpu == gpu, name
        enc = serde.tensor_from_bytes(cpu)
        dec = codec.decode(enc, TensorSpec.of(name, x), device="cuda")
        assert torch.equal(dec.cpu(), codec.decode(enc, TensorSpec.of(name, x)))


# --- fast mode: how far the count strays from k -------------------------------------------------


@pytest.mark.parametrize("p", [0.01, 0.001])
def test_fast_mode_count_near_k(p):
    """Documented in SBC's docstring: typically within ~6 % of k, bound asserted here: 25 %."""
    n = 1 << 20
    k = round(p * n)
    deviations = []
    for seed in range(6):
        x = seeded(n, 100 + seed, "student") * (1 + seed)
        nnz = SBC(p).encode(x, "t").payload.nnz
        deviations.append(abs(nnz - k) / k)
    assert max(deviations) < 0.25, deviations
    assert sum(deviations) / len(deviations) < 0.12, deviations


def test_fast_mode_falls_back_to_exact_on_degenerate_tensors():
    # 99.9 % zeros: the sampled thresholds are 0, so a threshold pass would select everything
    x = torch.zeros(300_000)
    x[::1000] = torch.arange(300, dtype=torch.float32) - 100
    assert SBC(0.01, "fast").encode(x, "t") == SBC(0.01, "exact").encode(x, "t")


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", [SBC(), SBC(0.001, "exact"), SBC(0.05, "fast", 5000)], ids=repr)
def test_config_round_trip(codec):
    kit.check_config_round_trip(codec)


def test_defaults():
    c = SBC()
    assert c.get_config() == {"id": "sbc", "p": 0.01, "mode": "fast", "sample_size": 25600}
    assert get_codec({"id": "sbc", "p": 0.01}) == c


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"p": 0.7}, "p"),
        ({"p": 0.0}, "p"),
        ({"p": -0.1}, "p"),
        ({"p": math.nan}, "p"),
        ({"p": "0.1"}, "p"),
        ({"p": True}, "p"),
        ({"mode": "slow"}, "mode"),
        ({"sample_size": 0}, "sample_size"),
        ({"sample_size": 10.5}, "sample_size"),
        ({"sample_size": True}, "sample_size"),
    ],
)
def test_invalid_config(kwargs, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        SBC(**kwargs)
    with pytest.raises(ConfigError, match=f"^{key}:"):
        get_codec({"id": "sbc", **kwargs})


def test_unknown_config_key():
    with pytest.raises(ConfigError, match="sbc"):
        SBC.from_config({"id": "sbc", "q": 3})


# --- golden fixtures --------------------------------------------------------------------------


def test_golden():
    kit.check_golden(SBC(0.01, "exact"), "exact-p0.01-normal4096", seeded(4096, 42).reshape(64, 64))
    kit.check_golden(SBC(0.001, "exact"), "exact-p0.001-student20000", seeded(20_000, 43, "student"))
    kit.check_golden(SBC(0.01, "fast"), "fast-p0.01-student100000", seeded(100_000, 44, "student"))
    kit.check_golden(SBC(0.01, "fast"), "zeros-300", torch.zeros(3, 100))
    kit.check_golden(SBC(0.25, "exact"), "ties-64", (torch.arange(64) % 5 - 2).float())


def test_a_side_of_mean_zero_is_sent_as_no_positions_and_the_papers_bytes_still_decode():
    """A frozen layer's all-zero update: fedcomp sends nnz = 0 (zeros-300 above, 2 bytes of
    payload); the paper's ``k`` zero-valued positions (what fedcomp sent before, kept as
    zeros-300-paper) decode to the same tensor, bit for bit."""
    paper = serde.tensor_from_bytes((kit.FIXTURES / "sbc" / "v1" / "zeros-300-paper.bin").read_bytes())
    assert isinstance(paper.payload, SBCPayload) and paper.payload.nnz == 3 and paper.payload.mean == 0.0
    zeros = torch.zeros(3, 100)
    sent = SBC(0.01, "fast").encode(zeros, "zeros-300")
    assert sent.payload == SBCPayload(mean=0.0, golomb_b=0, nnz=0, bits=b"")
    spec = TensorSpec("zeros-300", (3, 100))
    for enc in (paper, sent):
        out = SBC(0.01).decode(enc, spec)
        assert torch.equal(out, zeros) and not torch.signbit(out).any()
    # every path: exact and fast mode, a large tensor, the whole-update kernel, -0.0 among the zeros
    signed = torch.zeros(300_000)
    signed[::7] = -0.0
    items = [("a", zeros.reshape(-1)), ("b", signed), ("c", signed[:50_000])]
    for codec in (SBC(0.01, "exact"), SBC(0.05, "fast")):
        many = codec.encode_many(items)
        assert [(e or codec.encode(t, n)).payload.nnz for (n, t), e in zip(items, many)] == [0, 0, 0]
        assert [e is None for e in many] == [False, True, False]  # (the kernel's, Python's, the kernel's)
    # a negative side whose mean rounds to -0.0 keeps its positions: its zeros decode negative
    x = torch.zeros(100)
    x[0] = -(2.0**-149)  # k = 2: the positive side's mean is 0, the negative side's -2**-150 -> -0.0
    enc = SBC(0.02, "exact").encode(x, "x")
    assert isinstance(enc.payload, SBCPayload) and enc.payload.nnz == 2
    assert enc.payload.mean == 0.0 and math.copysign(1.0, enc.payload.mean) < 0
    assert torch.signbit(SBC(0.02).decode(enc, TensorSpec("x", (100,)))).sum() == 2


# --- hostile payloads -------------------------------------------------------------------------


def _good():
    x = seeded(1000, 11)
    return SBC(0.01, "exact").encode(x, "layer.w"), TensorSpec.of("layer.w", x)


def _with(enc, **changes):
    p = enc.payload
    fields = {"mean": p.mean, "golomb_b": p.golomb_b, "nnz": p.nnz, "bits": p.bits, **changes}
    return EncodedTensor(enc.name, enc.shape, enc.dtype, enc.codec_id, enc.codec_version, SBCPayload(**fields))


def test_bad_payloads_raise_payload_error():
    enc, spec = _good()
    p = enc.payload
    codec = SBC(0.01, "exact")
    cases = {
        "truncated": _with(enc, bits=p.bits[:-3]),
        "trailing": _with(enc, bits=p.bits + b"\x00"),
        "nnz > numel": _with(enc, nnz=1001),
        "golomb_b too big": _with(enc, golomb_b=63),
        "runs past end": _with(enc, bits=p.bits[: p.nnz * p.golomb_b // 8] + b"\xff" * 3),
        "overflow": _with(enc, nnz=2, bits=encode_positions(torch.tensor([5, 1500]), p.golomb_b)),
        "nan mean": _with(enc, mean=math.nan),
        "inf mean": _with(enc, mean=math.inf),
        "mean beyond float32": _with(enc, mean=1e300),
        "wrong payload type": EncodedTensor(
            enc.name, enc.shape, enc.dtype, enc.codec_id, enc.codec_version, DensePayload("float32", b"")
        ),
    }
    assert torch.equal(codec.decode(enc, spec), codec.decode(_with(enc), spec))
    reasons = {
        "nnz > numel": "nnz 1001 exceeds the tensor's 1000 elements",
        "nan mean": "mean nan is not a finite float32",
        "inf mean": "mean inf is not a finite float32",
        "mean beyond float32": "mean 1e+300 is not a finite float32",
        "wrong payload type": "payload is DensePayload, expected SBCPayload",
    }
    kit.check_rejects(codec, spec, cases, not_on_wire=("wrong payload type", "mean beyond float32"), reasons=reasons)


@pytest.mark.parametrize("field, value", [("nnz", "10"), ("golomb_b", None), ("mean", "0.5"), ("bits", "0110")])
def test_payload_fields_of_the_wrong_type(field, value):
    """What a caller building payloads in Python (not from protobuf) can get wrong."""
    enc, spec = _good()
    with pytest.raises(PayloadError) as info:
        SBC(0.01, "exact").decode(_with(enc, **{field: value}), spec)
    assert (info.value.tensor, info.value.reason) == ("layer.w", "SBC payload fields have the wrong types")


@given(
    st.binary(max_size=80),
    st.integers(0, 2**64 - 1) | st.integers(0, 40),
    st.integers(0, 2**32 - 1) | st.integers(0, 70),
    st.floats(width=32),
    st.integers(0, 300),
)
@settings(max_examples=300, deadline=None)
def test_fuzz_decode_only_payload_errors(bits, nnz, b, mean, numel):
    spec = TensorSpec("fz", (numel,))
    enc = EncodedTensor("fz", (numel,), "float32", "sbc", 1, SBCPayload(mean, b, nnz, bits))
    with kit.LargestTensor() as made:
        try:
            out = SBC().decode(enc, spec)
        except PayloadError as exc:
            assert exc.tensor == "fz"
        else:
            assert out.shape == (numel,) and int((out != 0).sum()) <= nnz
    # work stays linear in the payload and the tensor, whatever nnz and b claim (256 x 8: the bit table)
    assert made.largest <= max(numel, 8 * len(bits), 256 * 8)


# --- order statistics from the tails (the thresholds of both modes) -----------------------------


@settings(max_examples=150, deadline=None)
@given(
    n=st.sampled_from([1, 2, 7, 100, 8191, 8192, 9000, 30_000]),
    r_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(["t", "ties", "zeros", "hidden", "on-stride", "negative"]),
)
def test_order_stats_equal_a_full_sort(n, r_frac, seed, kind):
    """_order_stats must return exactly sorted(a)[r-1] and sorted(a)[n-r], including when the
    strided subsample misses the extremes ('hidden': every non-zero value off the stride) or
    holds all of them ('on-stride': its bounds then leave fewer than r values, which forces the
    fallback), with masses of ties, and leave ``a`` untouched."""
    from fedcomp.codecs import sbc

    rng = np.random.default_rng(seed)
    a = rng.standard_t(3, n).astype(np.float32)
    if kind == "ties":
        a = rng.integers(-3, 4, n).astype(np.float32)
    elif kind == "zeros":
        a[rng.random(n) < 0.95] = 0.0
    elif kind == "hidden":
        a = np.zeros(n, dtype=np.float32)
        off = np.arange(n) % sbc._ORDER_STEP != 0
        a[off] = rng.standard_normal(int(off.sum())).astype(np.float32) * 100
    elif kind == "on-stride":
        a[:: sbc._ORDER_STEP] = 1000.0 + np.arange(a[:: sbc._ORDER_STEP].shape[0], dtype=np.float32)
        a[sbc._ORDER_STEP // 2 :: sbc._ORDER_STEP] = -1000.0 - rng.random(
            a[sbc._ORDER_STEP // 2 :: sbc._ORDER_STEP].shape[0]
        )
    elif kind == "negative":
        a = -np.abs(a) - 1.0
    r = 1 + int(r_frac * (n - 1))
    before = a.copy()
    lo, hi = sbc._order_stats(a, r)
    ordered = np.sort(a)
    assert (lo, hi) == (ordered[r - 1], ordered[n - r])
    assert np.array_equal(a, before)


# --- masses of ties at the tail bounds (frozen layers, coarse grids) ----------------------------


def _lowest_index_extremes_np(a: np.ndarray, k: int, largest: bool) -> list[int]:
    """:func:`lowest_index_extremes` by a stable sort in NumPy (fast enough for 100K values)."""
    order = np.argsort(-a if largest else a, kind="stable")  # (-0.0 and 0.0 compare equal)
    return np.sort(order[:k]).tolist()


def _tied(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "zeros":  # a frozen layer
        return np.zeros(n, np.float32)
    if kind == "signed-zeros":
        return np.where(rng.random(n) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    if kind == "mostly-zeros":  # fewer than k values beyond zero on each side: the rest are zeros
        a = np.zeros(n, np.float32)
        few = rng.choice(n, n // 300, replace=False)
        a[few] = rng.standard_normal(few.size).astype(np.float32)
        return a
    if kind == "grid":  # a coarse grid: the bound's value is held by a fifth of the tensor
        return rng.integers(-2, 3, n).astype(np.float32)
    if kind == "one-sided":  # zeros and positives: the low side is all ties
        a = np.zeros(n, np.float32)
        a[rng.random(n) < 0.3] = 1.5
        return a
    if kind == "late-ties":  # distinct values, then the ties: from just before a chunk's end on
        from fedcomp.codecs import sbc

        a = rng.standard_normal(n).astype(np.float32) * 1e-3
        a[sbc._CPU_CHUNK - 100 :] = 7.0  # (the scan for them gathers across chunks)
        return a
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["zeros", "signed-zeros", "mostly-zeros", "grid", "one-sided", "late-ties"])
@pytest.mark.parametrize(("n", "p"), [(20_000, 0.01), (300_000, 0.01), (100_000, 0.05)])
def test_masses_of_ties_select_what_a_sort_selects(kind: str, n: int, p: float) -> None:
    """A frozen layer's zeros or a coarse grid put a mass of equal values at a bound: the scan
    from the start for the first of them (no sort of the whole array) keeps exactly the sort's
    ``k`` per side, ties to the lowest index; and SBC's bytes are the reference's (where it is
    quick)."""
    from fedcomp.codecs import sbc

    a = _tied(kind, n, np.random.default_rng(n))
    k = max(1, round(p * n))
    taken = []
    real = sbc._extremes_at_ties

    def spy(*args):  # type: ignore[no-untyped-def]
        found = real(*args)
        taken.append(found is not None)
        return found

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sbc, "_extremes_at_ties", spy)
        hi, lo = _extreme_positions_cpu(a, k)
    assert hi.tolist() == _lowest_index_extremes_np(a, k, True)
    assert lo.tolist() == _lowest_index_extremes_np(a, k, False)
    # the scan for ties served it, not the whole-array order (a coarse grid at p = 5 %, and the
    # late ties where they are few or absent, leave few enough candidates for the usual scan)
    if kind not in ("grid", "late-ties") or (kind == "late-ties" and n == 300_000):
        assert taken == [True]
    if n <= 20_000:  # (the pure-Python reference takes seconds beyond)
        check_against_reference(torch.from_numpy(a), p)
