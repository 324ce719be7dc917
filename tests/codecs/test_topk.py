import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp.codecs import TensorSpec, get_codec
from fedcomp.codecs.golomb import encode_positions, golomb_b
from fedcomp.codecs.topk import TopK, _topk_positions_torch, topk_positions
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.wire.payloads import DensePayload, EncodedTensor, SparsePayload
from tests.codecs import kit

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def seeded(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# --- against a slow reference -----------------------------------------------------------------


def reference_topk(values: list[float], k: int) -> list[int]:
    """The k largest |v|, ties to the lowest index, ascending: a plain sort."""
    order = sorted(range(len(values)), key=lambda i: (-abs(values[i]), i))
    return sorted(order[: min(k, len(values))])


def reference(values: list[float], p: float | None, ranges) -> list[int]:
    if ranges is None:
        return reference_topk(values, max(1, round(p * len(values)))) if values else []
    out = []
    for s, e, k in ranges:
        out += [s + i for i in reference_topk(values[s:e], k)]
    return out


@st.composite
def cases(draw, min_size=0):
    n = draw(st.integers(min_size, 400))
    kind = draw(st.sampled_from(["normal", "ties", "zeros"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "normal":
        a = rng.standard_normal(n)
    elif kind == "ties":
        a = rng.integers(-3, 4, n) * 0.5
    else:
        a = np.where(rng.random(n) < 0.9, 0.0, rng.standard_normal(n))
    x = torch.from_numpy(a.astype(np.float32))
    if n == 0 or draw(st.booleans()):
        return x, draw(st.floats(0.001, 1.0)), None
    cuts = sorted(draw(st.sets(st.integers(0, n), max_size=8)))
    ranges = []
    for s, e in zip(cuts[::2], cuts[1::2]):
        if s < e:
            ranges.append((s, e, draw(st.integers(0, e - s))))
    return x, None, tuple(ranges)


@given(cases())
@FAST
def test_selection_matches_reference(case):
    x, p, ranges = case
    codec = TopK(p=p, ranges=ranges)
    dec, _ = kit.round_trip(codec, x)
    want = reference([float(v) for v in x.tolist()], p, ranges)
    assert codec.select(x).tolist() == want
    mask = torch.zeros(x.numel(), dtype=torch.bool)
    mask[want] = True
    assert torch.equal(dec[mask], x[mask]) and not bool(dec[~mask].any())


@given(cases(min_size=1))  # _topk_positions_torch's contract: 1 <= k <= numel
@settings(max_examples=60, deadline=None)
def test_device_generic_selection_matches_cpu(case):
    """The torch code CUDA runs, run on CPU, selects exactly what the NumPy CPU code selects."""
    x, p, _ = case
    k = max(1, round((p or 0.1) * x.numel()))
    assert _topk_positions_torch(x, k, "t").tolist() == topk_positions(x, k).tolist()


# --- round trips --------------------------------------------------------------------------------

CODECS = [TopK(0.01), TopK(0.1, values="float16"), TopK(1.0), TopK(ranges=((0, 1, 1), (10, 40, 5), (100, 1000, 7)))]
TENSORS = {
    "normal-4096": lambda: seeded(4096).reshape(64, 64),
    "zeros": lambda: torch.zeros(50, 20),
    "scalar": lambda: torch.tensor(-2.5),
    "one": lambda: torch.ones(1),
    "big": lambda: seeded(300_000, 3) * 1e-3,
}


@pytest.mark.parametrize("device", kit.devices())
@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("tensor", list(TENSORS))
def test_round_trip(codec, tensor, device):
    x = TENSORS[tensor]().to(device)
    if codec.ranges and codec.ranges[-1][1] > x.numel():
        with pytest.raises(ConfigError, match="ranges"):
            codec.encode(x, "t")
        return
    dec, _ = kit.round_trip(codec, x)
    nnz = codec.encode(x, "t").payload.nnz
    selected = codec.select(x.cpu().reshape(-1).float())
    if codec.p is not None:
        assert selected.numel() == min(x.numel(), max(1, round(codec.p * x.numel())))
    else:
        assert selected.numel() == sum(k for _, _, k in codec.ranges)
    assert nnz == int((x.cpu().reshape(-1)[selected] != 0).sum())  # the selected non-zeros only
    if codec.values == "float32":  # kept entries are exact
        kept = dec != 0
        assert torch.equal(dec[kept], x[kept])


def test_empty_tensor_and_empty_ranges():
    assert TopK(0.5).encode(torch.zeros(0, 3), "t").payload == SparsePayload(0, 0, b"", "float32", b"")
    enc = TopK(ranges=()).encode(seeded(100), "t")
    assert enc.payload.nnz == 0 and enc.payload.bits == b"" and enc.payload.values == b""
    assert not TopK(ranges=()).decode(enc, TensorSpec("t", (100,))).any()


def test_zeros_among_the_k_largest_are_not_sent():
    # A frozen layer and a tensor with 3 non-zeros, k = 100: nothing, then the 3, are sent.
    x = torch.zeros(1000)
    assert TopK(0.1).encode(x, "frozen").payload == SparsePayload(0, 0, b"", "float32", b"")
    x[[5, 500, 999]] = torch.tensor([1.5, -2.0, 0.25])
    for codec in (TopK(0.1), TopK(ranges=((0, 600, 50), (600, 1000, 50))), TopK(0.1, values="float16")):
        enc, recon = codec.encode_with_reconstruction(x, "sparse")
        assert enc.payload.nnz == 3 and torch.equal(recon, x)
        assert torch.equal(codec.decode(enc, TensorSpec("sparse", (1000,))), x)


def test_selection_semantics():
    x = torch.tensor([0.5, -4.0, 3.0, 0.0, -3.0, 1.0, 2.0, -2.0])
    assert TopK(0.25).select(x).tolist() == [1, 2]  # |-4|, then the tie 3 / -3 goes to index 2
    assert TopK(0.375).select(x).tolist() == [1, 2, 4]
    # ranges: top 1 of [0, 4), nothing of [4, 6), top 2 of [6, 8); index 1 and 2 are outside
    codec = TopK(ranges=((0, 1, 1), (4, 6, 0), (6, 8, 2)))
    enc, recon = codec.encode_with_reconstruction(x, "t")
    assert recon.tolist() == [0.5, 0, 0, 0, 0, 0, 2.0, -2.0]
    assert enc.payload.golomb_b == golomb_b(3 / 8)


def test_float16_values_saturate_and_round():
    x = torch.tensor([1e6, -1e6, 0.1, 3.0])
    dec, _ = kit.round_trip(TopK(1.0, values="float16"), x)
    assert dec.tolist() == [65504.0, -65504.0, float(torch.tensor(0.1).half()), 3.0]


def test_non_finite_input_is_rejected():
    for bad in (math.nan, math.inf, -math.inf):
        x = seeded(10_000, 1)
        x[1234] = bad
        with pytest.raises(ValueError, match="'w'"):
            TopK(0.01).encode(x, "w")
        with pytest.raises(ValueError, match="'w'"):
            TopK(ranges=((1000, 2000, 5),)).encode(x, "w")
        TopK(ranges=((2000, 3000, 5),)).encode(x, "w")  # outside every range: not looked at


def test_other_float_dtypes():
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        dec, _ = kit.round_trip(TopK(0.05), seeded(3000, 5).to(dtype))
        assert dec.dtype == dtype


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", [TopK(0.01), TopK(0.5, values="float16"), TopK(ranges=()), CODECS[-1]], ids=repr)
def test_config_round_trip(codec):
    kit.check_config_round_trip(codec)


def test_config_shapes():
    c = TopK(ranges=[[0, 10, 2], [20, 30, 3]])
    assert c.ranges == ((0, 10, 2), (20, 30, 3))
    assert c.get_config() == {"id": "topk", "p": None, "ranges": [[0, 10, 2], [20, 30, 3]], "values": "float32"}
    assert get_codec({"id": "topk", "p": 0.01}) == TopK(0.01)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({}, "p"),
        ({"p": 0.1, "ranges": ()}, "p"),
        ({"p": 0.0}, "p"),
        ({"p": 1.5}, "p"),
        ({"p": math.nan}, "p"),
        ({"p": True}, "p"),
        ({"p": 0.1, "values": "bfloat16"}, "values"),
        ({"ranges": [(0, 10)]}, "ranges"),
        ({"ranges": [(5, 5, 0)]}, "ranges"),
        ({"ranges": [(-1, 5, 1)]}, "ranges"),
        ({"ranges": [(0, 5, 6)]}, "ranges"),
        ({"ranges": [(0, 5, 1.5)]}, "ranges"),
        ({"ranges": [(0, 5, 1), (4, 8, 1)]}, "ranges"),
        ({"ranges": [(10, 20, 1), (0, 5, 1)]}, "ranges"),
    ],
)
def test_invalid_config(kwargs, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        TopK(**kwargs)
    with pytest.raises(ConfigError, match=f"^{key}:"):
        get_codec({"id": "topk", **kwargs})


# --- golden fixtures --------------------------------------------------------------------------


def test_golden():
    kit.check_golden(TopK(0.01), "p0.01-normal4096", seeded(4096, 42).reshape(64, 64))
    kit.check_golden(TopK(0.05, values="float16"), "p0.05-f16-normal3000", seeded(3000, 43))
    kit.check_golden(TopK(ranges=((0, 100, 4), (700, 1000, 9))), "ranges-normal1000", seeded(1000, 44))
    kit.check_golden(TopK(0.25), "ties-64", (torch.arange(64) % 5 - 2).float())
    kit.check_golden(TopK(ranges=()), "empty-ranges-300", seeded(300, 45))


# --- hostile payloads -------------------------------------------------------------------------


def _good():
    x = seeded(1000, 11)
    return TopK(0.01).encode(x, "layer.w"), TensorSpec.of("layer.w", x)


def _with(enc, **changes):
    p = enc.payload
    fields = {
        "golomb_b": p.golomb_b,
        "nnz": p.nnz,
        "bits": p.bits,
        "value_encoding": p.value_encoding,
        "values": p.values,
        **changes,
    }
    return EncodedTensor(enc.name, enc.shape, enc.dtype, enc.codec_id, enc.codec_version, SparsePayload(**fields))


def test_bad_payloads_raise_payload_error():
    enc, spec = _good()
    p = enc.payload
    codec = TopK(0.01)
    nan = np.float32([math.nan]).tobytes()
    cases = {
        "truncated bits": _with(enc, bits=p.bits[:-2]),
        "trailing bits": _with(enc, bits=p.bits + b"\x00"),
        "nnz > numel": _with(enc, nnz=1001, values=b"\x00" * 4004),
        "values short": _with(enc, values=p.values[:-1]),
        "values long": _with(enc, values=p.values + b"\x00" * 4),
        "nnz vs values": _with(enc, nnz=p.nnz + 1),
        "float16 values": _with(enc, value_encoding="float16", values=p.values[: 2 * p.nnz]),
        "bfloat16 values": _with(enc, value_encoding="bfloat16", values=p.values[: 2 * p.nnz]),
        "float64 values": _with(enc, value_encoding="float64", values=p.values * 2),
        "position past numel": _with(enc, bits=encode_positions(torch.arange(990, 1000) + 5, p.golomb_b)),
        "nan value": _with(enc, values=nan + p.values[4:]),
        "inf value": _with(enc, values=np.float32([math.inf]).tobytes() + p.values[4:]),
        "golomb_b too big": _with(enc, golomb_b=63),
        "wrong payload type": EncodedTensor(
            enc.name, enc.shape, enc.dtype, enc.codec_id, enc.codec_version, DensePayload("float32", b"")
        ),
    }
    # exactly what the server logs (10 positions with golomb_b 6, float32 values)
    reasons = {
        "truncated bits": "position bits truncated: 8 bytes cannot hold 10 codewords of at least 7 bits",
        "trailing bits": "1 trailing bytes after the position bitstream",
        "nnz > numel": "nnz 1001 exceeds the tensor's 1000 elements",
        "values short": "values are 39 bytes, expected 40 for nnz 10",
        "values long": "values are 44 bytes, expected 40 for nnz 10",
        "nnz vs values": "values are 40 bytes, expected 44 for nnz 11",
        "float16 values": "value encoding 'float16' where 'float32' was expected",
        "bfloat16 values": "value encoding 'bfloat16' where 'float32' was expected",
        "float64 values": "value encoding 'float64' where 'float32' was expected",
        "position past numel": "positions overflow the tensor's 1000 elements",
        "nan value": "a value is NaN or infinite",
        "inf value": "a value is NaN or infinite",
        "golomb_b too big": "golomb_b 63 is outside [0, 62]",
        "wrong payload type": "payload is DensePayload, expected SparsePayload",
    }
    assert set(reasons) == set(cases)
    assert torch.equal(codec.decode(enc, spec), codec.decode(_with(enc), spec))
    kit.check_rejects(codec, spec, cases, not_on_wire=("wrong payload type",), reasons=reasons)


def test_decoder_with_ranges_rejects_selections_outside_them():
    x = seeded(1000, 12)
    ranges = ((100, 200, 3), (500, 600, 2))
    spec = TensorSpec.of("w", x)
    mine = TopK(ranges=ranges)
    assert TopK(ranges=ranges).decode(mine.encode(x, "w"), spec).count_nonzero() == 5
    outside = {  # what the server logs: the first stray position, or the range over its k
        TopK(0.01): "position 24 is outside the allocated ranges",
        TopK(ranges=((100, 200, 4),)): "4 positions in range [100, 200) allocated k = 3",
        TopK(ranges=((150, 250, 2),)): "position 212 is outside the allocated ranges",
    }
    for other, reason in outside.items():
        enc = other.encode(x, "w")
        TopK(0.5).decode(enc, spec)  # a p-codec accepts any valid message
        with pytest.raises(PayloadError) as info:
            mine.decode(enc, spec)
        assert (info.value.tensor, info.value.reason) == ("w", reason)
    # a client allocated nothing this round sends nothing
    with pytest.raises(PayloadError) as info:
        TopK(ranges=()).decode(TopK(0.01).encode(x, "w"), spec)
    assert (info.value.tensor, info.value.reason) == ("w", "10 positions where no range was allocated")


def test_ranges_past_the_tensor_are_a_config_error_naming_it():
    x = seeded(1000, 12)
    with pytest.raises(ConfigError) as info:
        TopK(ranges=((0, 10, 1), (20, 2000, 5))).encode(x, "w")
    assert str(info.value) == "ranges: stop 2000 exceeds tensor 'w''s 1000 elements"
    assert TopK(ranges=((0, 10, 1), (20, 1000, 5))).encode(x, "w").payload.nnz == 6  # stop == numel is fine


@given(
    st.binary(max_size=80),
    st.integers(0, 2**64 - 1) | st.integers(0, 40),
    st.integers(0, 2**32 - 1) | st.integers(0, 70),
    st.binary(max_size=200),
    st.integers(0, 300),
)
@settings(max_examples=300, deadline=None)
def test_fuzz_decode_only_payload_errors(bits, nnz, b, values, numel):
    spec = TensorSpec("fz", (numel,))
    enc = EncodedTensor("fz", (numel,), "float32", "topk", 1, SparsePayload(b, nnz, bits, "float32", values))
    with kit.LargestTensor() as made:
        try:
            out = TopK(0.1).decode(enc, spec)
        except PayloadError as exc:
            assert exc.tensor == "fz"
            out = None
    # linear in the payload and the tensor, whatever nnz and b claim (256 x 8: the bit table)
    assert made.largest <= max(numel, 8 * len(bits), len(values), 256 * 8)
    if out is not None:
        assert out.shape == (numel,) and int((out != 0).sum()) <= nnz
        # the values land in order at ascending positions
        sent = torch.frombuffer(bytearray(values), dtype=torch.float32) if values else torch.zeros(0)
        assert torch.equal(out[out != 0], sent[sent != 0])
