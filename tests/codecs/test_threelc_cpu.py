"""3LC's CPU paths: zero runs coded and read in NumPy, the sparse decoder that skips the
expansion, and tensors split among the CPU threads; each against the plain-Python reference or
the single-threaded / dense path it must equal bit for bit. Every test runs twice: with the C
kernels (fedcomp/_native/threelc.c, when built) and with the NumPy fallback."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp.codecs.sbc as sbc
import fedcomp.codecs.threelc as threelc
from fedcomp.codecs.base import TensorSpec
from fedcomp.codecs.threelc import ThreeLC, groups
from fedcomp.errors import PayloadError
from fedcomp.wire.payloads import ThreeLCPayload
from tests.codecs import reference_threelc as ref
from tests.codecs.test_threelc import S_VALUES, sparse_tensors

FAST = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)


@pytest.fixture(autouse=True, params=["kernel", "numpy"])
def cpu_path(request, monkeypatch):
    """Every test on both CPU paths: the C kernels (when built) and the NumPy fallback."""
    if request.param == "kernel" and threelc._KERNEL is None:
        pytest.skip("fedcomp._native._threelc is not built or FEDCOMP_NATIVE=0")
    if request.param == "numpy":
        monkeypatch.setattr(threelc, "_KERNEL", None)
    return request.param


@st.composite
def packed_streams(draw):
    """Packed base-3^5 bytes (0..242) with runs of 121 of every length around the 14-byte cap."""
    pieces = draw(
        st.lists(
            st.one_of(
                st.integers(0, 40).map(lambda r: bytes([121]) * r),
                st.binary(min_size=1, max_size=4).map(lambda b: bytes(v % 243 for v in b)),
            ),
            max_size=12,
        )
    )
    return b"".join(pieces)


@FAST
@given(data=packed_streams())
def test_numpy_zero_runs_equal_the_reference(data):
    x = np.frombuffer(data, dtype=np.uint8)
    coded = threelc._zero_run_encode_np(x)
    assert coded.tobytes() == ref.zero_run_encode(data)
    assert threelc._zero_run_decode_np(coded, len(data), "t").tobytes() == data


@FAST
@given(data=packed_streams(), extra=st.integers(1, 20))
def test_numpy_zero_run_length_mismatch_is_a_payload_error(data, extra):
    coded = np.frombuffer(ref.zero_run_encode(data), dtype=np.uint8)
    for wrong in (len(data) + extra, len(data) - extra):
        if wrong >= 0:
            with pytest.raises(PayloadError, match="zero runs expand"):
                threelc._literals_np(coded, wrong, "t")


@FAST
@given(data=packed_streams(), pad=st.integers(0, 4), scale=st.sampled_from([0.0, 2.5, 1e-41, 3.4e38]))
def test_sparse_decoder_equals_the_dense_one(data, pad, scale):
    """Every padding length, scale 0 (whose -1 digits decode to -0.0) and a subnormal scale:
    the sparse scatter must give the dense unpacker's float32 bits."""
    g = len(data)
    numel = max(0, 5 * g - pad)
    if groups(numel) != g or numel == 0:
        return
    x = np.frombuffer(data, dtype=np.uint8)
    dense = np.empty(numel, dtype=np.float32)
    threelc._unpack_scale_cpu(x, scale, dense)
    pos = np.flatnonzero(x != threelc.ZERO_GROUP)
    sparse = threelc._sparse_unpack_scale_np(pos, x[pos], numel, scale)
    assert sparse.tobytes() == dense.tobytes()
    assert dense.tolist() == [v * np.float32(scale) for v in np.float32(ref.unpack(data, numel))]


@pytest.mark.parametrize("zero_run", [True, False])
@pytest.mark.parametrize("density", [0.0001, 0.5])
def test_codec_decode_takes_either_path_to_the_same_values(monkeypatch, zero_run, density):
    """A sparse update (the sparse decoder) and a dense one (expansion + unpack) each decode to
    the reference's values, whichever way the switch is set."""
    rng = np.random.default_rng(1)
    n = 50_003
    a = np.where(rng.random(n) < density, rng.standard_t(3, n), 0.0).astype(np.float32)
    enc = ThreeLC(zero_run=zero_run).encode(torch.from_numpy(a), "w")
    want = ref.decode(enc.payload.scale, enc.payload.data, n, zero_run)
    spec = TensorSpec("w", (n,), torch.float32)
    for switch in (1, 1 << 40):  # 1: only an all-121 stream is sparse; 2**40: every stream is
        monkeypatch.setattr(threelc, "_SPARSE_DECODE", switch)
        got = ThreeLC(zero_run=zero_run).decode(enc, spec, "cpu")
        assert got.tolist() == want


def test_threads_split_a_tensor_into_the_same_bytes(monkeypatch):
    """Ranges of groups coded on several threads give the single-threaded bytes, values and
    reconstruction; so does the max|T| pass (and a NaN in any range is still found)."""
    rng = np.random.default_rng(2)
    n = 5 * 3000 + 3
    a = (rng.standard_t(3, n) * (rng.random(n) < 0.2)).astype(np.float32)
    codec = ThreeLC(s=1.5)
    spec = TensorSpec("w", (n,), torch.float32)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one_enc, one_recon = codec.encode_with_reconstruction(torch.from_numpy(a), "w")
    one_dec = codec.decode(one_enc, spec, "cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(threelc, "_CPU_CHUNK", 64)
    monkeypatch.setattr(threelc, "_SCAN_CHUNK", 128)
    monkeypatch.setattr(threelc, "_PARALLEL_GROUPS", 100)
    monkeypatch.setattr(threelc, "_PARALLEL_VALUES", 500)  # the kernels' split (_encode_split)
    monkeypatch.setattr(threelc, "_SPARSE_DECODE", 1 << 40)
    monkeypatch.setattr(sbc, "_PARALLEL_MIN", 100)
    assert len(sbc.split_run(lambda b, e: (b, e), groups(n), 64, 100)) == 4
    enc, recon = codec.encode_with_reconstruction(torch.from_numpy(a), "w")
    assert enc.payload == one_enc.payload
    assert recon.numpy().tobytes() == one_recon.numpy().tobytes()
    monkeypatch.setattr(threelc, "_SPARSE_DECODE", 1)  # the dense unpacker, split in ranges
    assert codec.decode(enc, spec, "cpu").numpy().tobytes() == one_dec.numpy().tobytes()
    for i in (0, 127, 128, n // 2, n - 1):  # chunk and range edges: the scale is max|T| (s = 1)
        for big in (1e6, -1e6):
            b = a.copy()
            b[i] = big
            assert ThreeLC().encode(torch.from_numpy(b), "w").payload.scale == 1e6
    for bad in (np.nan, np.inf, -np.inf):
        b = a.copy()
        b[-2] = bad  # in the last range
        with pytest.raises(ValueError, match="non-finite"):
            codec.encode(torch.from_numpy(b), "w")


def test_sparse_decoder_rejects_a_stream_that_expands_wrong():
    payload = ThreeLCPayload(scale=1.0, numel=100, zero_run=True, data=bytes([255, 250]))  # 14 + 9 groups
    spec = TensorSpec("w", (100,), torch.float32)
    with pytest.raises(PayloadError, match="expand to 23 groups, expected 20"):
        ThreeLC()._decode(payload, spec, torch.device("cpu"))


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(x=sparse_tensors(), s=S_VALUES, zero_run=st.booleans())
def test_sparse_and_dense_packing_give_the_reference_bytes(monkeypatch, x, s, zero_run):
    """Packing from the values beyond the threshold alone (sparse) and packing every group
    (dense) give the reference's bytes and the same reconstruction bits, padding included."""
    x = x.reshape(-1)
    if x.numel() == 0 or not bool(torch.isfinite(x).all()):
        return
    m, data = ref.encode(x.tolist(), s, zero_run)
    out = {}
    for switch in (1, 1 << 40):  # 1: every tensor sparse; 2**40: only one with no +-1 value
        monkeypatch.setattr(threelc, "_SPARSE_ENCODE", switch)
        enc, recon = ThreeLC(s=s, zero_run=zero_run).encode_with_reconstruction(x, "t")
        assert (enc.payload.scale, enc.payload.data) == (m, data)
        out[switch] = recon.numpy().tobytes()
    assert out[1] == out[1 << 40]  # bits: -0.0 and 0.0 differ


@pytest.mark.parametrize("switch", [1, 1 << 40])
def test_values_at_the_threshold_pack_like_the_reference(monkeypatch, switch):
    """Values exactly at +-t (the least that rounds to +-1) and the float32 just inside it."""
    t = threelc.round_threshold(1.0)
    inside = np.nextafter(t, np.float32(0.0))
    row = [1.0, t, -t, inside, -inside, 0.0, -0.0, -1.0]
    x = torch.tensor(row * 40 + [t, -t, 0.5], dtype=torch.float32)
    monkeypatch.setattr(threelc, "_SPARSE_ENCODE", switch)
    enc = ThreeLC(s=1.0).encode(x, "t")
    assert (enc.payload.scale, enc.payload.data) == ref.encode(x.tolist(), 1.0, True)


@pytest.mark.parametrize("s", [1.0, 1.9])
def test_scale_clamped_at_float32_max_misses_no_value(monkeypatch, s):
    """With m clamped to the float32 maximum, the scan's bound must stay below m / 2."""
    f32_max = float(np.finfo(np.float32).max)
    rng = np.random.default_rng(5)
    x = (rng.uniform(-1, 1, 3000) * 1e-3).astype(np.float32)
    x[[10, 700, 2999]] = [3.0e38, -1.8e38, 2.0e38]  # with s = 1.9 and m = f32 max: 2e38 > t > 1.7e38
    for values in (x, x * np.float32(1e-30)):
        enc = ThreeLC(s=s).encode(torch.from_numpy(values), "t")
        assert (enc.payload.scale, enc.payload.data) == ref.encode(values.tolist(), s, True)
    assert ThreeLC(s=1.9).encode(torch.from_numpy(x), "t").payload.scale == f32_max
