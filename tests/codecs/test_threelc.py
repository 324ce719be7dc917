"""3LC: against the paper's rules, a plain-Python reference, and hostile payloads."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp.codecs.threelc as threelc
from fedcomp.codecs.base import TensorSpec
from fedcomp.codecs.threelc import (
    MAX_RUN,
    ThreeLC,
    groups,
    pack_base243,
    quantize,
    unpack_base243,
    zero_run_decode,
    zero_run_encode,
)
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.wire import serde
from fedcomp.wire.payloads import DensePayload, EncodedTensor, ThreeLCPayload
from tests.codecs import kit
from tests.codecs import reference_threelc as ref

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
F32_MAX = float(torch.finfo(torch.float32).max)


def seeded(n, seed=0, kind="normal"):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "student":  # student-t, df 3: heavy tails, like model deltas
        z = torch.randn(n, generator=g, dtype=torch.float64)
        chi2 = (torch.randn(n, 3, generator=g, dtype=torch.float64) ** 2).sum(1)
        return (z / torch.sqrt(chi2 / 3)).to(torch.float32)
    raise ValueError(kind)


def u8(data) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


def no_negative_zero(t: torch.Tensor) -> bool:
    return not bool((torch.signbit(t) & (t == 0)).any())


# --- against the plain-Python reference -------------------------------------------------------


@st.composite
def sparse_tensors(draw):
    """Float32 tensors, 0..3000 values: mostly zero to dense, scales far apart, special values,
    and zeroed stretches, so that the packed bytes have runs of 121 of many lengths."""
    n = draw(st.integers(0, 3000))
    seed = draw(st.integers(0, 2**32 - 1))
    density = draw(st.sampled_from([0.0, 0.0005, 0.002, 0.01, 0.05, 0.3, 1.0]))
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n) * 10.0 ** draw(st.integers(-40, 30))
    a = np.where(rng.random(n) < density, a, 0.0)
    if draw(st.booleans()):  # few distinct values: exact halves of m, ties for round()
        a = np.where(a != 0, rng.integers(-4, 5, n) * 0.25, 0.0)
    for start, length in draw(st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 400)), max_size=3)):
        a[start : start + length] = 0.0
    x = torch.from_numpy(a.astype(np.float32))
    special = st.floats(width=32, allow_nan=False, allow_infinity=False)
    for i, v in draw(st.lists(st.tuples(st.integers(0, 2999), special), max_size=4)):
        if i < n:
            x[i] = v
    return x


S_VALUES = st.sampled_from([1.0, 1.5, 1.75, 1.9]) | st.floats(1.0, 2.0, exclude_max=True)


@FAST
@given(x=sparse_tensors(), s=S_VALUES, zero_run=st.booleans())
def test_bytes_match_reference(x, s, zero_run):
    codec = ThreeLC(s=s, zero_run=zero_run)
    enc, recon = codec.encode_with_reconstruction(x, "t")
    m, data = ref.encode(x.tolist(), s, zero_run)
    p = enc.payload
    assert isinstance(p, ThreeLCPayload)
    assert (p.scale, p.numel, p.zero_run) == (m, x.numel(), zero_run)
    assert p.data == data
    dec = codec.decode(serde.tensor_from_bytes(serde.tensor_to_bytes(enc)), TensorSpec.of("t", x))
    expect = torch.tensor(ref.decode(m, data, x.numel(), zero_run), dtype=torch.float32)
    assert torch.equal(dec, expect) and no_negative_zero(dec)
    assert torch.equal(recon, dec) and no_negative_zero(recon)


@st.composite
def zero_heavy_bytes(draw):
    """Bytes 0..242 with runs of 121 of every length 1..40 between other bytes."""
    run = st.integers(1, 40).map(lambda k: [121] * k)
    other = st.lists(st.integers(0, 242), min_size=1, max_size=4)
    pieces = draw(st.lists(run | other, max_size=25))
    return bytes(b for piece in pieces for b in piece)


@settings(max_examples=300, deadline=None)
@given(data=zero_heavy_bytes())
def test_zero_run_matches_reference_and_inverts(data):
    enc = zero_run_encode(u8(data))
    assert enc.dtype == torch.uint8
    assert bytes(enc.tolist()) == ref.zero_run_encode(data)
    assert ref.zero_run_decode(bytes(enc.tolist())) == data
    assert bytes(zero_run_decode(enc, len(data), "t").tolist()) == data


@pytest.mark.parametrize(
    "data, coded",
    [
        ([], []),
        ([121], [121]),
        ([121] * 2, [243]),
        ([121] * 13, [254]),
        ([121] * 14, [255]),
        ([121] * 15, [255, 121]),
        ([121] * 16, [255, 243]),
        ([121] * 28, [255, 255]),
        ([121] * 29, [255, 255, 121]),
        ([121] * 41, [255, 255, 254]),
        ([7, 121, 121, 7, 121, 242], [7, 243, 7, 121, 242]),
        ([0, 120, 122, 242], [0, 120, 122, 242]),
    ],
)
def test_zero_run_rule(data, coded):
    assert zero_run_encode(u8(data)).tolist() == coded
    assert ref.zero_run_encode(bytes(data)) == bytes(coded)
    assert zero_run_decode(u8(coded), len(data), "t").tolist() == data


@pytest.mark.parametrize("chunk", [1, 3, 7])
@settings(max_examples=25, deadline=None)
@given(x=sparse_tensors(), s=S_VALUES)
def test_chunked_paths_match_reference(chunk, x, s):
    """The fused encode/decode loops over chunks of groups: force many small chunks."""
    old = threelc._CPU_CHUNK
    threelc._CPU_CHUNK = chunk
    try:
        test_bytes_match_reference.hypothesis.inner_test(x, s, True)
    finally:
        threelc._CPU_CHUNK = old


# --- the paper's steps, one at a time ---------------------------------------------------------


def test_quantize_rounds_half_to_even():
    x = torch.tensor([1.0, 0.5, -0.5, 0.5000001, -0.5000001, 0.25, -1.0, -0.0])
    q, m = quantize(x, 1.0)
    assert m == 1.0
    assert q.dtype == torch.int8
    assert q.tolist() == [1, 0, 0, 1, -1, 0, -1, 0]
    q, m = quantize(torch.tensor([2.0, 1.5, -1.5, 1.4]), 1.5)  # m = 3: 1.5 / 3 is a tie
    assert m == 3.0 and q.tolist() == [1, 0, 0, 0]


def test_quantize_zero_and_empty():
    q, m = quantize(torch.zeros(7), 1.9)
    assert m == 0.0 and q.tolist() == [0] * 7
    q, m = quantize(torch.zeros(0), 1.0)
    assert m == 0.0 and q.numel() == 0


def test_pack_known_bytes():
    assert pack_base243(torch.zeros(5, dtype=torch.int8)).tolist() == [121]
    assert pack_base243(torch.ones(5, dtype=torch.int8)).tolist() == [242]
    assert pack_base243(-torch.ones(5, dtype=torch.int8)).tolist() == [0]
    assert pack_base243(torch.tensor([1, 0, -1, 0, 1], dtype=torch.int8)).tolist() == [2 * 81 + 27 + 0 + 3 + 2]
    # 7 values: digits 2,1,0,1,2,1,1 + padding 0,0,0; parts (2,1) (0,1) (2,1) (1,0) (0,0)
    q = torch.tensor([1, 0, -1, 0, 1, 0, 0], dtype=torch.int8)
    assert pack_base243(q).tolist() == [2 * 81 + 0 + 2 * 9 + 3, 81 + 27 + 9]
    assert pack_base243(q).tolist() == list(ref.pack(q.tolist()))


def test_unpack_every_byte():
    allb = torch.arange(243, dtype=torch.uint8)
    for n in range(1211, 1216):  # every padding length
        q = unpack_base243(allb, n)
        assert q.tolist() == ref.unpack(bytes(range(243)), n)
        dec = threelc._unpack_scale(allb, n, 2.5, torch.device("cpu"))
        assert torch.equal(dec, 2.5 * q.float()) and no_negative_zero(dec)
    with pytest.raises(ValueError):
        unpack_base243(torch.tensor([243], dtype=torch.uint8), 5)
    with pytest.raises(ValueError):
        unpack_base243(torch.tensor([1, 2], dtype=torch.uint8), 5)


@pytest.mark.parametrize("device", kit.devices())
@pytest.mark.parametrize("s", [1.0, 1.6])
def test_fused_path_matches_helpers(device, s):
    """Codec bytes = zero_run_encode(pack_base243(quantize(x))), over several CPU chunks."""
    n = 5 * threelc._CPU_CHUNK * 2 + 3
    x = (seeded(n, 3, "student") * (torch.rand(n, generator=torch.Generator().manual_seed(4)) < 0.3)).to(device)
    q, m = quantize(x, s)
    packed = pack_base243(q)
    enc, recon = ThreeLC(s=s).encode_with_reconstruction(x, "big")
    assert enc.payload.scale == m
    assert enc.payload.data == bytes(zero_run_encode(packed).cpu().tolist())
    assert torch.equal(recon, m * q.float())
    assert torch.equal(unpack_base243(packed, n), q)
    raw = torch.frombuffer(bytearray(enc.payload.data), dtype=torch.uint8)
    assert torch.equal(zero_run_decode(raw, groups(n), "big").to(device), packed)


# --- round trips, sizes, config ----------------------------------------------------------------


@pytest.mark.parametrize("device", kit.devices())
@pytest.mark.parametrize("shape", [(0,), (1,), (4,), (5,), (7, 3), (64, 3, 3, 3), (333, 31)])
@pytest.mark.parametrize("s, zero_run", [(1.0, True), (1.5, True), (1.9, False)])
def test_round_trip_error_bound(device, shape, s, zero_run):
    n = math.prod(shape)
    x = seeded(n, n, "student").reshape(shape).to(device)
    dec, recon = kit.round_trip(ThreeLC(s=s, zero_run=zero_run), x)
    _, m = quantize(x, s)
    err = (x.double() - dec.double()).abs()
    assert bool((err <= m / 2).all())
    if n:  # values are -m, 0, m; with s = 1 the largest magnitude survives exactly
        assert set(dec.unique().tolist()) <= {-m, 0.0, m}
        if s == 1.0:
            assert float(dec.abs().max()) == float(x.abs().max())


@pytest.mark.parametrize("device", kit.devices())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_round_trip_other_dtypes(device, dtype):
    x = seeded(999, 1).to(dtype).reshape(9, 111).to(device)
    dec, _ = kit.round_trip(ThreeLC(s=1.25), x)
    assert dec.dtype == dtype


def test_extreme_values():
    # max|T| * s overflows float32: m is clamped to the float32 maximum, still >= |T|
    x = torch.tensor([3e38, -3e38, 1.0, 2e38, -1.6e38])
    dec, _ = kit.round_trip(ThreeLC(s=1.5), x)
    assert ThreeLC(s=1.5).encode(x).payload.scale == F32_MAX
    assert dec.tolist() == [F32_MAX, -F32_MAX, 0.0, F32_MAX, 0.0]
    # subnormals only
    u = 2.0**-149
    x = torch.tensor([u, -2 * u, 3 * u, 0.0])
    dec, _ = kit.round_trip(ThreeLC(), x)
    assert dec.tolist() == [0.0, -3 * u, 3 * u, 0.0]
    dec, _ = kit.round_trip(ThreeLC(), torch.tensor([u, -2 * u]))  # u / 2u is a tie: 0
    assert dec.tolist() == [0.0, -2 * u]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_refused(bad):
    x = torch.tensor([1.0, bad, 2.0])
    with pytest.raises(ValueError, match="non-finite"):
        ThreeLC().encode(x, "w")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("s, zero_run", [(1.0, True), (1.75, True), (1.3, False)])
def test_cuda_bytes_equal_cpu(s, zero_run):
    codec = ThreeLC(s=s, zero_run=zero_run)
    for n, seed in [(4099, 0), (5 * threelc._CPU_CHUNK * 3 + 1, 1), (1_000_003, 2)]:
        x = seeded(n, seed, "student")
        x[n // 3 : n // 2] = 0
        cpu = codec.encode(x, "t")
        gpu = codec.encode(x.cuda(), "t")
        assert serde.tensor_to_bytes(cpu) == serde.tensor_to_bytes(gpu)
        spec = TensorSpec.of("t", x)
        assert torch.equal(codec.decode(cpu, spec, "cuda").cpu(), codec.decode(cpu, spec, "cpu"))


def test_zero_tensor_compresses_280x():
    n = 70 * 10000
    x = torch.zeros(n)
    enc = ThreeLC().encode(x, "zeros")
    data = enc.payload.data
    assert data == b"\xff" * (n // 70)  # 140000 groups of 121 in runs of 14
    ratio = 4 * n / len(data)
    assert ratio == pytest.approx(280, rel=0.02)
    message = serde.tensor_to_bytes(enc)
    whole = 4 * n / len(message)
    print(f"zero tensor of {n} float32: payload data {ratio:.1f}x, whole message {whole:.1f}x ({len(message)} bytes)")
    assert whole == pytest.approx(280, rel=0.02)
    dec, _ = kit.round_trip(ThreeLC(), x)
    assert not dec.any()


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("n", [0, 1, 4, 5, 6, 4099, 10_000, 10_007])
def test_without_zero_run_is_1_6_bits_per_value(n, zeros):
    x = seeded(n, 7) * (0 if zeros else 1)  # all zero: zero-run encoding would shrink it most
    enc = ThreeLC(zero_run=False, s=1.9).encode(x, "t")
    assert len(enc.payload.data) == -(-n // 5)
    if n and n % 5 == 0:
        assert 8 * len(enc.payload.data) / n == 1.6


@pytest.mark.parametrize("codec", [ThreeLC(), ThreeLC(s=1.75), ThreeLC(s=1.0, zero_run=False), ThreeLC(s=1.999)])
def test_config_round_trip(codec):
    kit.check_config_round_trip(codec)


def test_config_defaults():
    assert ThreeLC().get_config() == {"id": "3lc", "s": 1.0, "zero_run": True}
    assert ThreeLC(s=1) == ThreeLC()


@pytest.mark.parametrize(
    "params, key",
    [
        ({"s": 2.5}, "s:"),
        ({"s": 2.0}, "s:"),
        ({"s": 0.99}, "s:"),
        ({"s": math.nan}, "s:"),
        ({"s": "1.5"}, "s:"),
        ({"s": True}, "s:"),
        ({"zero_run": "yes"}, "zero_run:"),
        ({"zero_run": 1}, "zero_run:"),
    ],
)
def test_invalid_config(params, key):
    with pytest.raises(ConfigError, match=key):
        ThreeLC(**params)
    with pytest.raises(ConfigError, match=key):
        ThreeLC.from_config({"id": "3lc", **params})


def test_invalid_config_message_names_value():
    with pytest.raises(ConfigError, match=r"s: must be in \[1, 2\), got 2.5"):
        ThreeLC(s=2.5)
    with pytest.raises(ConfigError):
        ThreeLC.from_config({"id": "3lc", "sparsity": 1.5})


# --- golden fixtures ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "codec, case, tensor",
    [
        (ThreeLC(), "s1-normal-4099", seeded(4099, 0)),
        (ThreeLC(s=1.75), "s1.75-student-37x53", seeded(37 * 53, 1, "student").reshape(37, 53)),
        (ThreeLC(zero_run=False), "no-zero-run-normal-1000", seeded(1000, 2).reshape(10, 100)),
        (ThreeLC(), "zeros-7x11x13", torch.zeros(7, 11, 13)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_golden(codec, case, tensor):
    kit.check_golden(codec, case, tensor)


# --- hostile payloads --------------------------------------------------------------------------


def _valid(n=1234, zero_run=True, name="w"):
    x = seeded(n, 5, "student")
    x[100:900] = 0
    codec = ThreeLC(s=1.5, zero_run=zero_run)
    return codec, codec.encode(x, name), TensorSpec.of(name, x)


def _with(enc, **changes):
    return dataclasses.replace(enc, payload=dataclasses.replace(enc.payload, **changes))


def _rejects(codec, enc, spec, reason):
    """``enc`` is refused naming ``spec``'s tensor, with exactly ``reason`` (what the log says)."""
    with pytest.raises(PayloadError) as info:
        codec.decode(enc, spec)
    assert (info.value.tensor, info.value.reason) == (spec.name, reason)


@pytest.mark.parametrize("zero_run", [True, False])
def test_truncated_and_extra_bytes(zero_run):
    codec, enc, spec = _valid(zero_run=zero_run)
    data = enc.payload.data
    assert codec.decode(enc, spec).shape == spec.shape
    n, g = len(data), groups(spec.numel)  # 1234 values: 247 groups
    if zero_run:  # a short stream is judged by what it expands to
        _rejects(codec, _with(enc, data=data[:-1]), spec, f"zero runs expand to {g - 1} groups, expected {g}")
        _rejects(codec, _with(enc, data=b""), spec, f"zero runs expand to 0 groups, expected {g}")
        _rejects(codec, _with(enc, data=data + b"\x79"), spec, f"zero runs expand to {g + 1} groups, expected {g}")
        too_long = f"data is {n + 5000} bytes, more than the {g} groups it codes"
    else:
        _rejects(codec, _with(enc, data=data[:-1]), spec, f"data is {g - 1} bytes, expected {g}")
        _rejects(codec, _with(enc, data=b""), spec, f"data is 0 bytes, expected {g}")
        _rejects(codec, _with(enc, data=data + b"\x79"), spec, f"data is {g + 1} bytes, expected {g}")
        too_long = f"data is {n + 5000} bytes, expected {g}"
    _rejects(codec, _with(enc, data=data + b"\x00" * 5000), spec, too_long)


def test_zero_runs_expanding_past_the_shape():
    codec, enc, spec = _valid()
    data = enc.payload.data
    expected = groups(spec.numel)
    bigger = data[:-1] + bytes([255])  # the last byte now stands for fourteen groups
    with pytest.raises(PayloadError, match=f"zero runs expand to .* groups, expected {expected}") as info:
        codec.decode(_with(enc, data=bigger), spec)
    assert info.value.tensor == "w"
    # a tiny stream claiming a huge tensor fails before anything of its size is allocated
    huge = TensorSpec("w", (2**40,))
    enc_huge = dataclasses.replace(enc, shape=(2**40,), payload=ThreeLCPayload(1.0, 2**40, True, b"\xff" * 64))
    with kit.LargestTensor() as made:
        _rejects(codec, enc_huge, huge, f"zero runs expand to 896 groups, expected {groups(2**40)}")
        enc_huge = dataclasses.replace(enc_huge, payload=ThreeLCPayload(1.0, 2**40, False, b"\x00" * 64))
        _rejects(codec, enc_huge, huge, f"data is 64 bytes, expected {groups(2**40)}")
    assert made.largest <= 64


def test_numel_must_match_the_shape():
    codec, enc, spec = _valid()
    for numel in (spec.numel + 1, 0, 2**64 - 1, True):
        _rejects(codec, _with(enc, numel=numel), spec, f"payload has {numel!r} values, expected {spec.numel}")


@pytest.mark.parametrize("scale", [math.nan, -1.0, math.inf, -math.inf, -1e-30, True, "1"])
def test_bad_scale(scale):
    codec, enc, spec = _valid()
    _rejects(codec, _with(enc, scale=scale), spec, f"scale {scale!r} is not a finite number >= 0")


def test_a_scale_of_minus_zero_is_refused():
    """No encoder sends -0.0 (``s * max|T|`` is +0.0 for an all-zero tensor), and decoders gave its
    zeros different signs (the per-tensor decoder skips a zero-run stream's groups of 121, the
    whole-update one writes them), so it is refused everywhere (FORMAT.md)."""
    codec, enc, spec = _valid()
    _rejects(codec, _with(enc, scale=-0.0), spec, "scale -0.0 is not +0.0, the zero scale")
    codec.decode(_with(enc, scale=0.0), spec)  # (+0.0 is the zero scale)


def test_wrong_payload_type_and_codes():
    codec, enc, spec = _valid()
    _rejects(
        codec,
        dataclasses.replace(enc, payload=DensePayload("float32", b"\x00" * 4 * spec.numel)),
        spec,
        "payload is DensePayload, expected ThreeLCPayload",
    )
    malformed = "malformed 3LC payload (data must be bytes, zero_run a bool)"
    _rejects(codec, _with(enc, data=list(enc.payload.data)), spec, malformed)
    _rejects(codec, _with(enc, zero_run=1), spec, malformed)
    codec, enc, spec = _valid(zero_run=False)
    data = bytearray(enc.payload.data)
    data[17] = 250
    _rejects(codec, _with(enc, data=bytes(data)), spec, "byte 250 is not a base-3^5 code (0..242) without zero runs")


def test_decode_zero_scale_and_empty():
    codec = ThreeLC()
    spec = TensorSpec("e", (0, 3))
    enc = EncodedTensor("e", (0, 3), "float32", "3lc", 1, ThreeLCPayload(0.0, 0, True, b""))
    assert codec.decode(enc, spec).shape == (0, 3)
    bad = dataclasses.replace(enc, payload=ThreeLCPayload(0.0, 0, True, b"\x79"))
    _rejects(codec, bad, spec, "data is 1 bytes, more than the 0 groups it codes")
    spec = TensorSpec("z", (6,))
    enc = EncodedTensor("z", (6,), "float32", "3lc", 1, ThreeLCPayload(0.0, 6, False, bytes([242, 0])))
    assert codec.decode(enc, spec).tolist() == [0.0] * 6


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.binary(max_size=600) | zero_heavy_bytes(),
    numel=st.integers(0, 3000) | st.sampled_from([2**31, 2**40]),
    scale=st.floats(width=32) | st.just(0.0),
    zero_run=st.booleans(),
)
def test_fuzz_random_payloads(data, numel, scale, zero_run):
    codec = ThreeLC()
    spec = TensorSpec("fuzz", (numel,))
    enc = EncodedTensor("fuzz", (numel,), "float32", "3lc", 1, ThreeLCPayload(scale, numel, zero_run, data))
    with kit.LargestTensor() as made:
        try:
            out = codec.decode(enc, spec)
        except PayloadError as exc:
            assert exc.tensor == "fuzz"
            out = None
    # nothing bigger than the payload can expand to (a byte: at most 14 groups of 5 values),
    # however large the claimed numel (up to 2**40)
    assert made.largest <= 5 * MAX_RUN * len(data) + 5
    if out is not None:
        assert out.shape == (numel,) and out.dtype == torch.float32
        assert set(out.unique().tolist()) <= {-scale, 0.0, scale}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    zero_run=st.booleans(),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.integers(-3, 3),
)
def test_fuzz_mutated_payloads(zero_run, edits, cut):
    codec, enc, spec = _valid(n=777, zero_run=zero_run, name="mut")
    data = bytearray(enc.payload.data)
    for at, value in edits:
        data[at % len(data)] = value
    data = data[:cut] if cut < 0 else data + bytes([121] * cut)
    with kit.LargestTensor() as made:
        try:
            out = codec.decode(_with(enc, data=bytes(data)), spec)
        except PayloadError as exc:
            assert exc.tensor == "mut"
        else:
            assert out.shape == spec.shape
            assert set(out.unique().tolist()) <= {-enc.payload.scale, 0.0, enc.payload.scale}
    assert made.largest <= 5 * groups(spec.numel)  # the (5, groups) digit buffer at most


# --- the CPU (NumPy, compare-based) path against the torch (division-based) path ---------------


@pytest.mark.parametrize("chunk", [3, 1 << 15])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=sparse_tensors(), s=S_VALUES)
def test_cpu_path_equals_the_torch_path(chunk, x, s):
    """The CPU encoder quantizes by two compares against round_threshold(m) instead of dividing:
    its bytes and reconstruction must equal the torch path's (the one CUDA runs) on every input,
    ties, subnormals and float32-max scales included; so must the CPU decoder's values."""
    x = x.reshape(-1)
    m = threelc.scale_for(threelc.max_abs(x), s)
    if x.numel() == 0 or m == 0.0:
        return
    old = threelc._CPU_CHUNK
    threelc._CPU_CHUNK = chunk
    try:
        t = threelc.round_threshold(m)
        assert t is not None
        recon = np.empty(x.numel(), dtype=np.float32)
        packed = threelc._quantize_pack_cpu(x.numpy(), t, m, recon)
        want_packed, want_recon = threelc._quantize_pack(x, m)  # the torch path, here on CPU
        assert packed.tobytes() == want_packed.numpy().tobytes()
        assert recon.tobytes() == want_recon.numpy().tobytes()  # bits: -0.0 and 0.0 differ
        for scale in (m, 0.0):
            out = np.empty(x.numel(), dtype=np.float32)
            threelc._unpack_scale_cpu(packed, scale, out)
            want = threelc._unpack_scale_torch(torch.from_numpy(packed), x.numel(), scale, torch.device("cpu"))
            assert out.tobytes() == want.numpy().tobytes()
    finally:
        threelc._CPU_CHUNK = old


@pytest.mark.parametrize("m", [1.0, 3.0, 1e-30, 1.4e-45, 2.8e-45, 7e-45, 1e-40, F32_MAX, 0.1, 1.0000001])
def test_round_threshold_is_the_division_boundary(m):
    """Every float32 at or above t rounds to 1 after float32 division by m, the one below it not."""
    m32 = np.float32(m)
    t = threelc.round_threshold(float(m32))
    assert t is not None and t > 0
    below = np.nextafter(t, np.float32(0))
    got = torch.round(torch.tensor([t, below, -t, -below], dtype=torch.float32) / torch.tensor(m32)).tolist()
    assert got == [1.0, 0.0, -1.0, 0.0]


def test_decode_buffers_are_sized_by_the_tensor():
    """The torch path's chunk buffers (~44 bytes a group) are capped by the tensor: a small
    tensor's decode allocates about half its own size beyond the output, not _DEV_CHUNK's."""
    for g in (1, 100, 5000, 100_000, 10**7):
        w = threelc._width(g, torch.device("meta"))
        assert 1 <= w <= g and w <= threelc._DEV_CHUNK
        assert 44 * w <= max(11 * g, 44 * threelc._MIN_WIDTH)  # 44 w bytes vs the tensor's 20 g bytes
    assert threelc._width(10**8, torch.device("meta")) == threelc._DEV_CHUNK
