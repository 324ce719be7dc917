"""The exact sparse codec (fedcomp.codecs.sparse): every entry above a threshold, Golomb positions
plus float32 or float16 values."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp.codecs import TensorSpec, get_codec
from fedcomp.codecs.golomb import encode_positions
from fedcomp.codecs.sparse import FP16_THRESHOLD, Sparse, fp16_error_bound
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.wire.payloads import DensePayload, EncodedTensor, SparsePayload
from tests.codecs import kit

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def seeded(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def union_of_sparse_updates(n: int, clients: int, p: float, seed: int) -> torch.Tensor:
    """A FedAvg-style aggregate of ``clients`` sparse updates (SBC-like: one value per client on
    its own ``p`` fraction of positions): nonzero exactly on the union of their positions."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(n)
    for c in range(clients):
        pos = torch.randperm(n, generator=g)[: max(1, int(p * n))]
        out[pos] += (1.0 if c % 2 else -1.0) * float(torch.rand(1, generator=g)) * 0.01 / clients
    return out


@st.composite
def tensors(draw):
    n = draw(st.integers(0, 500))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    density = draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
    scale = 10.0 ** draw(st.integers(-9, 3))  # subnormal float16 territory up to large values
    a = np.where(rng.random(n) < density, rng.standard_normal(n) * scale, 0.0)
    return torch.from_numpy(a.astype(np.float32))


# --- float32: exact ---------------------------------------------------------------------------


@FAST
@given(tensors())
def test_float32_round_trip_is_exact_and_sends_exactly_the_nonzeros(x):
    codec = Sparse("float32")
    dec, _ = kit.round_trip(codec, x)
    assert torch.equal(dec, x)
    assert codec.encode(x, "t").payload.nnz == int((x != 0).sum())


def test_union_of_sparse_updates_costs_the_union_not_the_model():
    x = union_of_sparse_updates(100_000, clients=10, p=0.01, seed=3)
    enc = Sparse("float32").encode(x, "w")
    nnz = int((x != 0).sum())
    assert enc.payload.nnz == nnz and 0.08 < nnz / x.numel() < 0.1
    # positions cost a few bits each (Golomb), values 4 bytes: far below the dense 400 kB
    assert len(enc.payload.values) == 4 * nnz and len(enc.payload.bits) < nnz
    assert torch.equal(Sparse("float32").decode(enc, TensorSpec.of("w", x)), x)


@pytest.mark.parametrize("device", kit.devices())
@pytest.mark.parametrize("codec", [Sparse("float32"), Sparse("float16"), Sparse("float32", 0.5)], ids=repr)
def test_round_trip_on_device(codec, device):
    x = union_of_sparse_updates(5000, 5, 0.02, seed=1).reshape(50, 100).to(device)
    dec, _ = kit.round_trip(codec, x)
    assert dec.device == x.device


def test_other_float_dtypes():
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = union_of_sparse_updates(3000, 4, 0.05, seed=5).to(dtype)
        dec, _ = kit.round_trip(Sparse("float32"), x)
        assert dec.dtype == dtype and torch.equal(dec, x)


def test_non_finite_input_is_rejected():
    for bad in (math.nan, math.inf, -math.inf):
        x = seeded(100)
        x[17] = bad
        with pytest.raises(ValueError, match="'w'"):
            Sparse("float32").encode(x, "w")


# --- float16: the documented bound --------------------------------------------------------------


@FAST
@given(tensors(), st.sampled_from([None, 0.0, 2.0**-6]))
def test_float16_error_within_the_documented_bound(x, threshold):
    codec = Sparse("float16", threshold)
    dec, _ = kit.round_trip(codec, x)
    bound = fp16_error_bound(x, codec.threshold)
    assert bool(((x - dec).abs() <= bound).all())
    # nothing is sent that the threshold drops, and no zero value is ever sent
    sent = dec != 0
    assert bool((x[sent].abs() > codec.threshold * float(x.abs().max())).all()) if x.numel() else True


def test_float16_error_bound_is_the_documented_one_and_is_reached():
    """``fp16_error_bound`` is ``max(t * max|x|, 2**-11 |x|, 2**-25)`` term by term (a looser bound
    would let the round-trip test above pass whatever the codec did), and float16's rounding
    reaches its middle term."""
    x = torch.tensor([1024.0, -3.0, 2.0**-20, 0.0])
    assert fp16_error_bound(x, 0.0).tolist() == [0.5, 3 * 2.0**-11, 2.0**-25, 2.0**-25]
    assert fp16_error_bound(x, 2.0**-12).tolist() == [0.5, 0.25, 0.25, 0.25]
    assert fp16_error_bound(torch.zeros(0)).numel() == 0
    tie = torch.tensor([1.0 + 2.0**-11, 4.0])  # half-way between two float16 values
    dec, _ = kit.round_trip(Sparse("float16", 0.0), tie)
    assert float((tie - dec).abs()[0]) == 2.0**-11 <= float(fp16_error_bound(tie, 0.0)[0])


def test_float16_threshold_keeps_rounding_residuals_from_being_resent():
    """The rounding residual that W - R keeps after a float16 round is below the next round's
    threshold when the next delta is as large: it is not resent as noise, entry by entry."""
    codec = Sparse("float16")
    assert codec.threshold == FP16_THRESHOLD
    first = union_of_sparse_updates(50_000, 10, 0.01, seed=7)
    residual = first - codec.decode(codec.encode(first, "w"), TensorSpec.of("w", first))
    assert int((residual != 0).sum()) > 1000  # float16 rounding touched most sent entries
    nxt = union_of_sparse_updates(50_000, 10, 0.01, seed=8)
    nxt = nxt * (float(first.abs().max()) / float(nxt.abs().max()))  # as large as the first
    sent = codec.encode(nxt + residual, "w").payload.nnz
    assert sent == int((nxt != 0).sum())
    # without the threshold every residual entry would go out again
    assert Sparse("float16", 0.0).encode(nxt + residual, "w").payload.nnz > sent + 1000


def test_float16_saturates_and_drops_underflow():
    x = torch.tensor([1e6, -1e6, 1e-9, 3.0])
    dec, _ = kit.round_trip(Sparse("float16", 0.0), x)
    assert dec.tolist() == [65504.0, -65504.0, 0.0, 3.0]


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", [Sparse(), Sparse("float16"), Sparse("float32", 0.25)], ids=repr)
def test_config_round_trip(codec):
    kit.check_config_round_trip(codec)


def test_config_defaults():
    assert Sparse().get_config() == {"id": "sparse", "values": "float32", "threshold": 0.0}
    assert get_codec({"id": "sparse", "values": "float16"}) == Sparse("float16", FP16_THRESHOLD)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"values": "bfloat16"}, "values"),
        ({"threshold": 1.0}, "threshold"),
        ({"threshold": -0.1}, "threshold"),
        ({"threshold": True}, "threshold"),
        ({"threshold": "0.1"}, "threshold"),
        ({"p": 0.1}, "sparse"),
    ],
)
def test_invalid_config(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        get_codec({"id": "sparse", **kwargs})


# --- the wire ---------------------------------------------------------------------------------


def test_golden():
    kit.check_golden(Sparse("float32"), "f32-union4096", union_of_sparse_updates(4096, 10, 0.01, 42).reshape(64, 64))
    kit.check_golden(Sparse("float16"), "f16-union3000", union_of_sparse_updates(3000, 10, 0.02, 43))
    kit.check_golden(Sparse("float32", 0.5), "f32-t0.5-normal1000", seeded(1000, 44))
    kit.check_golden(Sparse("float32"), "zeros-300", torch.zeros(300))


def test_one_decoder_accepts_both_value_encodings():
    """A downlink may switch between float16 and float32 rounds; one decoder reads both."""
    x = union_of_sparse_updates(2000, 5, 0.02, 9)
    spec = TensorSpec.of("w", x)
    for enc_codec in (Sparse("float16"), Sparse("float32")):
        enc = enc_codec.encode(x, "w")
        for dec_codec in (Sparse("float16"), Sparse("float32")):
            assert torch.equal(dec_codec.decode(enc, spec), enc_codec.decode(enc, spec))


def _good() -> tuple[EncodedTensor, TensorSpec]:
    x = torch.zeros(1000)
    x[torch.arange(10) * 97] = torch.arange(1, 11, dtype=torch.float32)
    return Sparse().encode(x, "w"), TensorSpec.of("w", x)


def _with(enc: EncodedTensor, **changes) -> EncodedTensor:
    p = enc.payload
    assert isinstance(p, SparsePayload)
    fields = {k: getattr(p, k) for k in ("golomb_b", "nnz", "bits", "value_encoding", "values")} | changes
    return EncodedTensor(enc.name, enc.shape, enc.dtype, enc.codec_id, enc.codec_version, SparsePayload(**fields))


def test_bad_payloads_raise_payload_error():
    enc, spec = _good()
    p = enc.payload
    assert isinstance(p, SparsePayload) and p.nnz == 10
    nan = np.float32([math.nan]).tobytes()
    cases = {
        "truncated bits": _with(enc, bits=p.bits[:-2]),
        "trailing bits": _with(enc, bits=p.bits + b"\x00"),
        "nnz > numel": _with(enc, nnz=1001, values=b"\x00" * 4004),
        "values short": _with(enc, values=p.values[:-1]),
        "values long": _with(enc, values=p.values + b"\x00" * 4),
        "nnz vs values": _with(enc, nnz=p.nnz + 1),
        "bfloat16 values": _with(enc, value_encoding="bfloat16", values=p.values[: 2 * p.nnz]),
        "float64 values": _with(enc, value_encoding="float64", values=p.values * 2),
        "position past numel": _with(enc, bits=encode_positions(torch.arange(990, 1000) + 5, p.golomb_b)),
        "nan value": _with(enc, values=nan + p.values[4:]),
        "inf value": _with(enc, values=np.float32([math.inf]).tobytes() + p.values[4:]),
        "zero value": _with(enc, values=np.float32([0.0]).tobytes() + p.values[4:]),
        "golomb_b too big": _with(enc, golomb_b=63),
        "wrong payload type": EncodedTensor(
            enc.name, enc.shape, enc.dtype, enc.codec_id, enc.codec_version, DensePayload("float32", b"")
        ),
    }
    reasons = {
        "truncated bits": "position bits truncated: 8 bytes cannot hold 10 codewords of at least 7 bits",
        "trailing bits": "1 trailing bytes after the position bitstream",
        "nnz > numel": "nnz 1001 exceeds the tensor's 1000 elements",
        "values short": "values are 39 bytes, expected 40 for nnz 10",
        "values long": "values are 44 bytes, expected 40 for nnz 10",
        "nnz vs values": "values are 40 bytes, expected 44 for nnz 11",
        "bfloat16 values": "value encoding 'bfloat16' is not one of ['float32', 'float16']",
        "float64 values": "value encoding 'float64' is not one of ['float32', 'float16']",
        "position past numel": "positions overflow the tensor's 1000 elements",
        "nan value": "a value is NaN or infinite",
        "inf value": "a value is NaN or infinite",
        "zero value": "a value is zero (the encoder never sends one)",
        "golomb_b too big": "golomb_b 63 is outside [0, 62]",
        "wrong payload type": "payload is DensePayload, expected SparsePayload",
    }
    assert set(reasons) == set(cases)
    assert torch.equal(Sparse().decode(enc, spec), Sparse().decode(_with(enc), spec))
    kit.check_rejects(Sparse(), spec, cases, not_on_wire=("wrong payload type",), reasons=reasons)


def test_envelope_of_another_codec_is_rejected():
    x = seeded(1000)
    enc = get_codec({"id": "topk", "p": 0.1}).encode(x, "w")  # the same payload type, another id
    with pytest.raises(PayloadError, match="codec 'topk' where 'sparse' was expected"):
        Sparse().decode(enc, TensorSpec.of("w", x))


@given(
    st.binary(max_size=80),
    st.integers(0, 2**64 - 1) | st.integers(0, 40),
    st.integers(0, 2**32 - 1) | st.integers(0, 70),
    st.sampled_from(["float32", "float16", "bfloat16", ""]),
    st.binary(max_size=200),
    st.integers(0, 300),
)
@settings(max_examples=300, deadline=None)
def test_fuzz_decode_only_payload_errors(bits, nnz, b, encoding, values, numel):
    spec = TensorSpec("fz", (numel,))
    enc = EncodedTensor("fz", (numel,), "float32", "sparse", 1, SparsePayload(b, nnz, bits, encoding, values))
    with kit.LargestTensor() as made:
        try:
            out = Sparse().decode(enc, spec)
        except PayloadError as exc:
            assert exc.tensor == "fz"
            out = None
    # linear in the payload and the tensor, whatever nnz and b claim (256 x 8: the bit table)
    assert made.largest <= max(numel, 8 * len(bits), len(values), 256 * 8)
    if out is not None:
        assert out.shape == (numel,) and int((out != 0).sum()) == nnz
