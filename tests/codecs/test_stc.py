import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp.codecs import TensorSpec, get_codec
from fedcomp.codecs import stc as stc_module
from fedcomp.codecs.golomb import encode_positions, expected_bits_per_position, golomb_b
from fedcomp.codecs.sbc import SBC, _sample_positions, _threshold_select_torch
from fedcomp.codecs.stc import STC
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.methods.feedback import ErrorFeedback
from fedcomp.wire import serde
from fedcomp.wire.payloads import DensePayload, EncodedTensor, SBCPayload, STCPayload
from tests.codecs import kit
from tests.codecs import reference_stc as ref

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

KINDS = ["normal", "ties", "zeros", "sparse", "negative", "wide", "subnormal", "const"]


def make_tensor(kind: str, n: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        a = rng.standard_normal(n)
    elif kind == "ties":  # few distinct magnitudes, both signs: ties across the selection boundary
        a = rng.integers(-3, 4, n).astype(np.float64) * 0.25
    elif kind == "zeros":  # mostly zeros, some of them negative zeros
        a = np.where(rng.random(n) < 0.9, 0.0, rng.standard_normal(n))
        a = np.where(rng.random(n) < 0.5, -a, a)
    elif kind == "sparse":  # fewer non-zeros than k at most p: zeros reach the top k
        a = np.where(rng.random(n) < 0.002, rng.standard_normal(n), 0.0)
    elif kind == "negative":  # mostly negative
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
    p = draw(st.sampled_from([0.001, 0.01, 0.1, 0.25, 0.5, 1.0]) | st.floats(0.0005, 1.0))
    return x, p


def check_against_reference(x: torch.Tensor, p: float) -> None:
    values = [float(v) for v in x.tolist()]
    mu, b, nnz, bits, signs = ref.stc(values, p)
    codec = STC(p, "exact")
    enc = codec.encode(x, "t")
    assert enc.payload == STCPayload(mu=mu, golomb_b=b, nnz=nnz, bits=bits, signs=signs)
    dec, _ = kit.round_trip(codec, x)
    assert dec.tolist() == ref.decode(mu, b, nnz, bits, signs, len(values))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, p", [(1999, 0.01), (2000, 0.5), (2000, 0.001), (30_000, 0.01)])
def test_exact_mode_matches_reference_on_larger_tensors(kind, n, p):
    check_against_reference(make_tensor(kind, n, n), p)


@given(small_tensors())
@FAST
def test_exact_mode_matches_reference(case):
    check_against_reference(*case)


@given(small_tensors())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fast_mode_on_small_tensors_is_exact(case):
    x, p = case  # at most sample_size elements: fast mode is exact mode
    assert STC(p, "fast", sample_size=2000).encode(x, "t") == STC(p, "exact").encode(x, "t")


@given(small_tensors(min_size=2), st.integers(1, 400))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fast_mode_matches_reference(case, sample_size):
    x, p = case
    n = x.numel()
    s = min(sample_size, n - 1)  # fewer samples than elements: the threshold pass runs
    sample = _sample_positions(n, s, "cpu").tolist()
    enc = STC(p, "fast", sample_size=s).encode(x, "t")
    mu, b, nnz, bits, signs = ref.stc_fast([float(v) for v in x.tolist()], p, sample)
    assert enc.payload == STCPayload(mu=mu, golomb_b=b, nnz=nnz, bits=bits, signs=signs)


# --- what the decoded tensor is -----------------------------------------------------------------


@pytest.mark.parametrize("p", [0.01, 0.001, 0.1])
def test_decoded_has_k_entries_of_magnitude_mu_with_the_inputs_signs(p):
    x = seeded(50_000, 7, "student").reshape(50, 1000)
    n = x.numel()
    k = max(1, round(p * n))
    enc, recon = STC(p).encode_with_reconstruction(x, "t")
    dec = STC(p).decode(serde.tensor_from_bytes(serde.tensor_to_bytes(enc)), TensorSpec.of("t", x))
    assert torch.equal(dec, recon)
    kept = dec != 0
    assert int(kept.sum()) == k == enc.payload.nnz
    mu = enc.payload.mu
    assert bool((dec[kept].abs() == mu).all())
    assert torch.equal(torch.sign(dec[kept]), torch.sign(x[kept]))  # both signs, each the input's
    assert bool((dec[kept] > 0).any()) and bool((dec[kept] < 0).any())
    # the kept entries are the k largest magnitudes, and mu is their mean magnitude
    assert float(x[kept].abs().min()) >= float(x[~kept].abs().max())
    assert mu == pytest.approx(float(x[kept].abs().double().mean()), rel=1e-6)


def test_selection_semantics():
    x = torch.tensor([0.0, 5.0, -1.0, 4.0, -9.0, 3.0, -8.0, 0.0, 2.0, 1.0])
    # k = 4: |-9|, |-8|, 5, 4 -> mu = 6.5, both signs (SBC would keep only {-9, -8})
    dec, _ = kit.round_trip(STC(0.4), x)
    assert dec.tolist() == [0, 6.5, 0, 6.5, -6.5, 0, -6.5, 0, 0, 0]
    assert SBC(0.2, "exact").decode(SBC(0.2, "exact").encode(x, "t"), TensorSpec.of("t", x)).count_nonzero() == 2
    # ties go to the lowest indices; zeros among the top k are not sent
    y = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0, 0.0])
    assert kit.round_trip(STC(0.5), y)[0].tolist() == [1, -1, 1, 0, 0, 0]
    enc = STC(1.0).encode(y, "t")
    assert enc.payload.nnz == 4 and enc.payload.signs == bytes([0b01010000])


def test_empty_and_all_zero_tensors():
    empty = STCPayload(mu=0.0, golomb_b=0, nnz=0, bits=b"", signs=b"")
    assert STC().encode(torch.zeros(0, 3), "t").payload == empty
    for x in (torch.zeros(50, 20), -torch.zeros(7)):
        enc = STC(0.1).encode(x, "t")
        assert enc.payload == empty
        dec, _ = kit.round_trip(STC(0.1), x)
        assert not bool(dec.any())


# --- round trips, devices, dtypes ------------------------------------------------------------

CODECS = [STC(0.01), STC(0.01, "fast"), STC(0.001, "fast"), STC(0.5), STC(1.0)]
TENSORS = {
    "normal-4096": lambda: seeded(4096),
    "student-3x100x700": lambda: seeded(210_000, 3, "student").reshape(3, 100, 700),
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
    flat_x, flat_d = x.reshape(-1), dec.reshape(-1)
    kept = flat_d != 0
    if not n:  # nothing to select: an empty message
        assert codec.encode(x, "t").payload.nnz == 0
        return
    k = min(n, max(1, round(codec.p * n)))
    nonzero = int((flat_x != 0).sum())
    if codec.mode == "exact":
        assert int(kept.sum()) == min(k, nonzero)
    else:
        assert int(kept.sum()) <= 2 * k
    assert torch.unique(flat_d[kept].abs()).numel() <= 1  # one magnitude
    assert torch.equal(torch.sign(flat_d[kept]), torch.sign(flat_x[kept]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes(dtype):
    x = seeded(3000, 5).to(dtype)
    dec, _ = kit.round_trip(STC(0.05), x)
    assert dec.dtype == dtype


@pytest.mark.parametrize("tensor", ["normal-4096", "student-3x100x700", "zeros", "empty", "scalar"])
def test_encode_skips_reconstruction_but_gives_the_same_message(tensor):
    x = TENSORS[tensor]()
    for codec in CODECS:
        assert codec.encode(x, "w") == codec.encode_with_reconstruction(x, "w")[0]
    with pytest.raises(TypeError):
        STC().encode(torch.zeros(3, dtype=torch.int32), "w")


def test_non_finite_input_is_rejected():
    for mode in ("exact", "fast"):
        for bad in (math.nan, math.inf, -math.inf):
            x = seeded(100_000, 1)
            x[12345] = bad
            if mode == "fast" and math.isnan(bad):
                x[_sample_positions(100_000, STC(0.01).sample_size, "cpu")[7]] = bad  # sampled
            with pytest.raises(ValueError, match=r"'w'.*STC cannot encode NaN or infinite"):
                STC(0.01, mode).encode(x, "w")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_cuda_and_cpu_give_identical_bytes(codec):
    for name, make in TENSORS.items():
        x = make()
        cpu = serde.tensor_to_bytes(codec.encode(x, name))
        assert cpu == serde.tensor_to_bytes(codec.encode(x.cuda(), name)), name
        enc = serde.tensor_from_bytes(cpu)
        dec = codec.decode(enc, TensorSpec.of(name, x), device="cuda")
        assert torch.equal(dec.cpu(), codec.decode(enc, TensorSpec.of(name, x)))


# --- fast mode -----------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.01, 0.001])
def test_fast_mode_count_near_k(p):
    n = 1 << 19
    k = round(p * n)
    deviations = []
    for seed in range(3):
        x = seeded(n, 100 + seed, "student") * (1 + seed)
        enc = STC(p, "fast").encode(x, "t")
        deviations.append(abs(enc.payload.nnz - k) / k)
    assert max(deviations) < 0.25, deviations
    assert sum(deviations) / len(deviations) < 0.12, deviations


def test_fast_mode_keeps_the_largest_magnitudes():
    x = seeded(200_000, 8, "student")
    dec = STC(0.01, "fast").decode(STC(0.01, "fast").encode(x, "t"), TensorSpec.of("t", x))
    kept = dec != 0
    assert float(x[kept].abs().min()) >= float(x[~kept].abs().max())
    assert torch.equal(torch.sign(dec[kept]), torch.sign(x[kept]))


def test_fast_mode_falls_back_to_exact_on_degenerate_tensors():
    # 99.9 % zeros: the sampled threshold is 0
    x = torch.zeros(300_000)
    x[::1000] = torch.arange(300, dtype=torch.float32) - 100
    assert STC(0.01, "fast").encode(x, "t") == STC(0.01, "exact").encode(x, "t")
    # a constant tensor: the threshold selects everything, more than 2 k
    c = torch.full((100_000,), 0.5)
    assert STC(0.01, "fast").encode(c, "t") == STC(0.01, "exact").encode(c, "t")


def test_fast_mode_device_generic_selection(monkeypatch):
    """The torch threshold pass CUDA runs (positions as tensors), run on CPU, gives the CPU bytes."""
    x = seeded(300_000, 9, "student")
    cpu = STC(0.01, "fast").encode(x, "t")

    def via_torch(a, thr_hi, thr_lo, limit):
        return _threshold_select_torch(torch.from_numpy(a), thr_hi, thr_lo, limit)

    monkeypatch.setattr(stc_module, "_threshold_select_cpu", via_torch)
    assert STC(0.01, "fast").encode(x, "t") == cpu


# --- bits per position ------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.01, 0.001])
def test_bits_per_position_near_golomb_formula(p):
    """Top-k positions of an i.i.d. tensor are a uniform k-subset: Golomb's expected length
    ``b + 1 / (1 - (1 - p)^(2^b))`` per position, plus one sign bit."""
    n = 4_000_000
    x = seeded(n, 7)
    enc = STC(p).encode(x, "t")
    payload = enc.payload
    k = round(p * n)
    assert payload.nnz == k and payload.golomb_b == golomb_b(p)
    expected = expected_bits_per_position(p, payload.golomb_b)
    per_position = len(payload.bits) * 8 / k
    assert abs(per_position - expected) / expected < 0.01, (per_position, expected)
    assert len(payload.signs) == math.ceil(k / 8)
    total = (len(payload.bits) + len(payload.signs)) * 8 / k
    assert abs(total - (expected + 1)) / (expected + 1) < 0.01, (total, expected + 1)


# --- error feedback ---------------------------------------------------------------------------


def test_error_feedback_over_two_rounds():
    """What was sent plus what stays in the residual is exactly what came in."""
    ef = ErrorFeedback(STC(0.01))
    codec = STC(0.01)
    x1, x2 = seeded(20_000, 21, "student"), seeded(20_000, 22, "student")
    sent = torch.zeros(20_000)
    for x in (x1, x2):
        enc = ef.encode(x, "w")
        dec = codec.decode(serde.tensor_from_bytes(serde.tensor_to_bytes(enc)), TensorSpec.of("w", x))
        assert int((dec != 0).sum()) == 200
        assert bool((dec > 0).any()) and bool((dec < 0).any())
        sent += dec
    residual = ef.residual("w")
    assert residual is not None
    torch.testing.assert_close(sent + residual, x1 + x2, rtol=1e-6, atol=1e-5)


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", [STC(), STC(0.001, "fast"), STC(1.0, "exact", 5000)], ids=repr)
def test_config_round_trip(codec):
    kit.check_config_round_trip(codec)


def test_defaults():
    c = STC()
    assert c.get_config() == {"id": "stc", "p": 0.01, "mode": "exact", "sample_size": 25600}
    assert get_codec({"id": "stc", "p": 0.01}) == c


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"p": 1.5}, "p"),
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
        STC(**kwargs)
    with pytest.raises(ConfigError, match=f"^{key}:"):
        get_codec({"id": "stc", **kwargs})


def test_unknown_config_key():
    with pytest.raises(ConfigError, match="stc"):
        STC.from_config({"id": "stc", "q": 3})


# --- golden fixtures --------------------------------------------------------------------------


def test_golden():
    kit.check_golden(STC(0.01), "exact-p0.01-normal4096", seeded(4096, 42).reshape(64, 64))
    kit.check_golden(STC(0.001), "exact-p0.001-student20000", seeded(20_000, 43, "student"))
    kit.check_golden(STC(0.01, "fast"), "fast-p0.01-student100000", seeded(100_000, 44, "student"))
    kit.check_golden(STC(0.01), "zeros-300", torch.zeros(3, 100))
    kit.check_golden(STC(0.25), "ties-64", (torch.arange(64) % 5 - 2).float())
    kit.check_golden(STC(0.5), "few-nonzeros-40", few_nonzeros())


def few_nonzeros() -> torch.Tensor:
    """5 non-zeros of both signs in 40 entries: fewer than k = 20, so nnz = 5."""
    x = torch.zeros(40)
    x[torch.tensor([3, 9, 17, 30, 38])] = torch.tensor([-7.0, 2.5, -0.5, 1.0, 3.0])
    return x


def test_golden_bytes_match_the_reference():
    """The stored bytes are what the paper's algorithm gives (for the exact-mode fixtures)."""
    for case, p in (("exact-p0.01-normal4096", 0.01), ("ties-64", 0.25), ("few-nonzeros-40", 0.5)):
        folder = kit.FIXTURES / "stc" / "v1"
        x = np.frombuffer((folder / f"{case}.input").read_bytes(), dtype=np.float32)
        mu, b, nnz, bits, signs = ref.stc([float(v) for v in x], p)
        stored = serde.tensor_from_bytes((folder / f"{case}.bin").read_bytes()).payload
        assert stored == STCPayload(mu=mu, golomb_b=b, nnz=nnz, bits=bits, signs=signs)


# --- hostile payloads -------------------------------------------------------------------------


def _good():
    x = seeded(1000, 11)
    return STC(0.01).encode(x, "layer.w"), TensorSpec.of("layer.w", x)


def _with(enc, **changes):
    p = enc.payload
    fields = {"mu": p.mu, "golomb_b": p.golomb_b, "nnz": p.nnz, "bits": p.bits, "signs": p.signs, **changes}
    return EncodedTensor(enc.name, enc.shape, enc.dtype, enc.codec_id, enc.codec_version, STCPayload(**fields))


def test_bad_payloads_raise_payload_error():
    enc, spec = _good()
    p = enc.payload
    assert p.nnz == 10 and len(p.signs) == 2
    codec = STC(0.01)
    cases = {
        "truncated": _with(enc, bits=p.bits[:-3]),
        "trailing": _with(enc, bits=p.bits + b"\x00"),
        "nnz > numel": _with(enc, nnz=1001, signs=b"\x00" * 126),
        "nnz vs signs": _with(enc, nnz=p.nnz + 7),
        "golomb_b too big": _with(enc, golomb_b=63),
        "runs past end": _with(enc, bits=p.bits[: p.nnz * p.golomb_b // 8] + b"\xff" * 3),
        "position past numel": _with(enc, bits=encode_positions(torch.arange(990, 1000) + 5, p.golomb_b)),
        "overflow": _with(enc, nnz=2, signs=b"\x00", bits=encode_positions(torch.tensor([5, 1500]), p.golomb_b)),
        "signs short": _with(enc, signs=p.signs[:1]),
        "signs long": _with(enc, signs=p.signs + b"\x00"),
        "signs padding": _with(enc, signs=p.signs[:1] + bytes([p.signs[1] | 0x01])),
        "signs empty for nnz": _with(enc, signs=b""),
        "signs for nnz 0": _with(enc, nnz=0, bits=b"", mu=0.0),
        "mu for nnz 0": _with(enc, nnz=0, bits=b"", signs=b""),
        "nan mu": _with(enc, mu=math.nan),
        "inf mu": _with(enc, mu=math.inf),
        "negative mu": _with(enc, mu=-p.mu),
        "negative zero mu": _with(enc, mu=-0.0),
        "mu beyond float32": _with(enc, mu=1e300),
        "mu a huge int": _with(enc, mu=10**400),
        "negative nnz": _with(enc, nnz=-1),
        "wrong field types": _with(enc, signs="abc"),
        "wrong payload type": EncodedTensor(
            enc.name, enc.shape, enc.dtype, enc.codec_id, enc.codec_version, DensePayload("float32", b"")
        ),
        "sbc payload": EncodedTensor(
            enc.name, enc.shape, enc.dtype, enc.codec_id, enc.codec_version, SBCPayload(1.0, p.golomb_b, 1, b"\x00")
        ),
    }
    assert torch.equal(codec.decode(enc, spec), codec.decode(_with(enc), spec))
    not_on_wire = (
        "wrong payload type",
        "sbc payload",
        "mu beyond float32",
        "mu a huge int",
        "negative nnz",
        "wrong field types",
    )
    # exactly what the server logs for each (10 positions with golomb_b 6, 2 sign bytes)
    reasons = {
        "truncated": "position bits truncated: 7 bytes cannot hold 10 codewords of at least 7 bits",
        "trailing": "1 trailing bytes after the position bitstream",
        "nnz > numel": "nnz 1001 exceeds the tensor's 1000 elements",
        "nnz vs signs": "sign bits are 2 bytes, expected 3 for nnz 17",
        "golomb_b too big": "golomb_b 63 is outside [0, 62]",
        "runs past end": "position bitstream runs past its end: 0 of 10 codewords are terminated",
        "position past numel": "positions overflow the tensor's 1000 elements",
        "overflow": "positions overflow the tensor's 1000 elements",
        "signs short": "sign bits are 1 bytes, expected 2 for nnz 10",
        "signs long": "sign bits are 3 bytes, expected 2 for nnz 10",
        "signs padding": "non-zero padding bits after the sign bits",
        "signs empty for nnz": "sign bits are 0 bytes, expected 2 for nnz 10",
        "signs for nnz 0": "sign bits are 2 bytes, expected 0 for nnz 0",
        "mu for nnz 0": f"mu {p.mu!r} with no kept positions (must be 0)",
        "nan mu": "mu nan is not a finite float32 >= 0",
        "inf mu": "mu inf is not a finite float32 >= 0",
        "negative mu": f"mu {-p.mu!r} is not a finite float32 >= 0",
        "negative zero mu": "mu -0.0 is not a finite float32 >= 0",
        "mu beyond float32": "mu 1e+300 is not a finite float32 >= 0",
        "mu a huge int": f"mu {10**400!r} is not a finite float32 >= 0",
        "negative nnz": "nnz -1 is negative",
        "wrong field types": "STC payload fields have the wrong types",
        "wrong payload type": "payload is DensePayload, expected STCPayload",
        "sbc payload": "payload is SBCPayload, expected STCPayload",
    }
    assert set(reasons) == set(cases)
    kit.check_rejects(codec, spec, cases, not_on_wire=not_on_wire, reasons=reasons)
    # a codec of another id refuses an STC tensor
    with pytest.raises(PayloadError, match=r"'layer\.w'"):
        SBC().decode(enc, spec)


@pytest.mark.parametrize(
    "field, value",
    [("nnz", "10"), ("nnz", True), ("golomb_b", None), ("mu", "0.5"), ("bits", "0110"), ("signs", [0, 1])],
)
def test_payload_fields_of_the_wrong_type(field, value):
    """What a caller building payloads in Python (not from protobuf) can get wrong."""
    enc, spec = _good()
    with pytest.raises(PayloadError) as info:
        STC(0.01).decode(_with(enc, **{field: value}), spec)
    assert (info.value.tensor, info.value.reason) == ("layer.w", "STC payload fields have the wrong types")


@given(
    st.binary(max_size=80),
    st.integers(0, 2**64 - 1) | st.integers(0, 40),
    st.integers(0, 2**32 - 1) | st.integers(0, 70),
    st.floats(width=32),
    st.binary(max_size=12),
    st.integers(0, 300),
)
@settings(max_examples=150, deadline=None)
def test_fuzz_decode_only_payload_errors(bits, nnz, b, mu, signs, numel):
    spec = TensorSpec("fz", (numel,))
    enc = EncodedTensor("fz", (numel,), "float32", "stc", 1, STCPayload(mu, b, nnz, bits, signs))
    with kit.LargestTensor() as made:
        try:
            out = STC().decode(enc, spec)
        except PayloadError as exc:
            assert exc.tensor == "fz"
        else:
            assert out.shape == (numel,) and int((out != 0).sum()) <= nnz
            assert bool((out.abs()[out != 0] == mu).all())
    # work stays linear in the payload and the tensor, whatever nnz and b claim (256 x 8: the bit table)
    assert made.largest <= max(numel, 8 * len(bits), 256 * 8)


@given(small_tensors(min_size=1), st.integers(0, 2**32 - 1))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fuzz_bit_flips_never_escape_payload_error(case, seed):
    """Flip one bit of a valid message's positions or signs: a PayloadError or a tensor of
    ``+-mu`` values at no more than ``nnz`` positions, never anything else."""
    x, p = case
    codec = STC(p)
    enc = codec.encode(x, "t")
    payload = enc.payload
    rng = np.random.default_rng(seed)
    field = "bits" if rng.random() < 0.5 or not payload.signs else "signs"
    data = bytearray(getattr(payload, field))
    if not data:  # no bit to flip: only an all-zero tensor sends nothing
        assert payload.nnz == 0 and not bool(x.any())
        return
    j = int(rng.integers(0, 8 * len(data)))
    data[j // 8] ^= 0x80 >> (j % 8)
    try:
        out = codec.decode(_with(enc, **{field: bytes(data)}), TensorSpec.of("t", x))
    except PayloadError as exc:
        assert exc.tensor == "t"
    else:
        kept = out.reshape(-1) != 0
        assert int(kept.sum()) <= payload.nnz
        assert bool((out.reshape(-1)[kept].abs() == payload.mu).all())
