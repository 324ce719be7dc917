"""The codec contract every codec inherits (fedcomp/codecs/base.py, fedcomp/codecs/__init__.py):
the envelope checks and their exact reasons, config look-up and round trips, equality and
hashing by config, shapes, dtypes and devices of what decode returns."""

import pytest
import torch

from fedcomp.codecs import (
    CODECS,
    SBC,
    STC,
    Codec,
    DenseFP16,
    DenseFP32,
    Identity,
    Lattice,
    TensorSpec,
    ThreeLC,
    TopK,
    get_codec,
)
from fedcomp.codecs.base import check_wire_dtype, expect_payload
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.wire.payloads import DensePayload, EncodedTensor, SBCPayload

# one codec of each kind that get_codec can build from a config alone (GradiVeQ needs its compressor)
PLAIN = [SBC(0.1, "exact"), STC(0.1), ThreeLC(1.5), TopK(p=0.1), DenseFP32(), DenseFP16(), Identity()]


def test_the_allow_list_names_every_codec_by_its_id():
    assert sorted(CODECS) == sorted(
        ["sbc", "stc", "3lc", "topk", "dense-fp32", "dense-fp16", "identity", "gradiveq", "lattice", "sparse"]
    )
    assert all(cls.codec_id == cid for cid, cls in CODECS.items())


def test_tensor_spec():
    assert TensorSpec("w", (3, 4, 5)).numel == 60
    assert TensorSpec("s", ()).numel == 1  # a scalar holds one value
    assert TensorSpec("e", (4, 0)).numel == 0
    x = torch.zeros(2, 3, dtype=torch.float16)
    assert TensorSpec.of("h", x) == TensorSpec("h", (2, 3), torch.float16)
    assert TensorSpec("w", (2,)).dtype == torch.float32  # the default


@pytest.mark.parametrize("codec", PLAIN, ids=repr)
def test_get_codec_builds_each_codec_from_its_config(codec):
    assert get_codec(codec.get_config()) == codec
    if isinstance(codec, TopK):  # no default selection: a bare id is not enough
        with pytest.raises(ConfigError, match="^p: give exactly one of p and ranges$"):
            get_codec("topk")
    else:
        assert get_codec(codec.codec_id) == type(codec)()  # a bare id: the defaults
    assert type(codec).from_config({k: v for k, v in codec.get_config().items() if k != "id"}) == codec


def test_unknown_codec_ids_are_config_errors_listing_the_known_ones():
    known = sorted(CODECS)
    for bad in ("zip", {"id": "zip"}, {"p": 0.1}):
        with pytest.raises(ConfigError) as info:
            get_codec(bad)  # type: ignore[arg-type]
        cid = bad if isinstance(bad, str) else bad.get("id")
        assert str(info.value) == f"id: unknown codec {cid!r}; known: {known}"


def test_from_config_checks_the_id_and_the_keys():
    with pytest.raises(ConfigError) as info:
        SBC.from_config({"id": "stc", "p": 0.1})
    assert str(info.value) == "id: 'stc' is not 'sbc'"
    with pytest.raises(ConfigError) as info:
        ThreeLC.from_config({"id": "3lc", "q": 1})
    assert str(info.value).startswith("3lc: ") and "'q'" in str(info.value)


def test_equality_and_hash_follow_the_config():
    assert SBC(0.1, "exact") == SBC(0.1, "exact") and hash(SBC(0.1, "exact")) == hash(SBC(0.1, "exact"))
    assert SBC(0.1) != SBC(0.2) and SBC(0.1) != STC(0.1) and SBC(0.1) != "sbc"
    # different settings hash apart (a dict of codecs does not degrade to one bucket)
    hashes = {hash(c) for c in PLAIN} | {hash(SBC(0.2, "exact")), hash(ThreeLC(1.25))}
    assert len(hashes) == len(PLAIN) + 2
    assert len({SBC(0.1, "exact"), SBC(0.1, "exact"), SBC(0.2)}) == 2
    assert repr(ThreeLC(1.5)) == "ThreeLC(s=1.5, zero_run=True)"
    assert repr(DenseFP32()) == "DenseFP32()"


def _enc(**changes) -> EncodedTensor:
    fields = {
        "name": "layer.w",
        "shape": (4, 4),
        "dtype": "float32",
        "codec_id": "dense-fp32",
        "codec_version": 1,
        "payload": DensePayload("float32", b"\0" * 64),
        **changes,
    }
    return EncodedTensor(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"name": "layer.b"}, "payload is for tensor 'layer.b'"),
        ({"codec_id": "sbc"}, "codec 'sbc' where 'dense-fp32' was expected"),
        ({"codec_version": 2}, "dense-fp32 version 2 is not supported (have 1)"),
        ({"shape": (16,)}, "shape [16] where [4, 4] was expected"),
        ({"dtype": "float16"}, "dtype float16 where float32 was expected"),
    ],
)
def test_the_envelope_must_match_the_spec(changes, reason):
    """What the server logs when a reply's tensor is not the one it expects (name, codec, codec
    version, shape, dtype), checked before the payload is looked at."""
    codec, spec = DenseFP32(), TensorSpec("layer.w", (4, 4))
    assert codec.decode(_enc(), spec).shape == (4, 4)
    with pytest.raises(PayloadError) as info:
        codec.decode(_enc(**changes), spec)
    assert (info.value.tensor, info.value.reason) == ("layer.w", reason)


def test_decode_returns_the_spec_dtype_on_the_device_asked_for():
    x = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    codec = DenseFP32()
    enc = codec.encode(x, "h")
    dec = codec.decode(enc, TensorSpec.of("h", x))
    assert dec.dtype == torch.float16 and dec.device == torch.device("cpu") and torch.equal(dec, x)
    assert codec.decode(enc, TensorSpec.of("h", x), device="cpu").device == torch.device("cpu")


def test_encode_checks_the_dtype_and_names_the_tensor():
    assert DenseFP32().encode(torch.ones(2)).name == ""  # the default name
    enc, recon = DenseFP32().encode_with_reconstruction(torch.ones(2, 1))
    assert enc.name == "" and enc.shape == (2, 1) and recon.shape == (2, 1)
    for codec in PLAIN:
        with pytest.raises(TypeError) as info:
            codec.encode(torch.ones(3, dtype=torch.int64), "counts")
        assert str(info.value) == "tensor 'counts': dtype torch.int64 is not supported"
    with pytest.raises(TypeError) as info:
        check_wire_dtype(torch.ones(1, dtype=torch.bool), "m")
    assert str(info.value) == "tensor 'm': dtype torch.bool is not supported"


def test_expect_payload_names_both_types():
    expect_payload(DensePayload("float32", b""), DensePayload, "w")  # the right type passes
    with pytest.raises(PayloadError) as info:
        expect_payload(SBCPayload(0.0, 0, 0, b""), DensePayload, "w")
    assert (info.value.tensor, info.value.reason) == ("w", "payload is SBCPayload, expected DensePayload")


@pytest.fixture
def float64_default():
    """torch's default dtype set to float64 (as scientific code often does), restored afterwards."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize("codec", PLAIN, ids=repr)
def test_float64_default_dtype_changes_nothing(codec, float64_default):
    """Encoding builds its float32 reconstruction and its bytes whatever torch's default dtype
    is: the same message and reconstruction as under the float32 default."""
    x = torch.linspace(-2.0, 3.0, 500, dtype=torch.float32).reshape(20, 25) ** 3
    enc, recon = codec.encode_with_reconstruction(x, "w")
    assert recon.dtype == torch.float32
    dec = codec.decode(enc, TensorSpec.of("w", x))
    assert dec.dtype == torch.float32 and torch.equal(dec, recon)
    torch.set_default_dtype(torch.float32)
    enc32, recon32 = codec.encode_with_reconstruction(x, "w")
    assert enc == enc32 and torch.equal(recon, recon32)


# decoding reads no decoded values back: every dense and 3LC tensor, the sparse codecs' empty ones
META_CASES = [(c, (0, 4)) for c in PLAIN] + [(c, (6, 7)) for c in PLAIN if not isinstance(c, (SBC, STC, TopK))]


@pytest.mark.parametrize("codec, shape", META_CASES, ids=lambda v: repr(v))
def test_decode_allocates_on_the_device_asked_for(codec, shape):
    """A decoder builds its output on the device it is given (a server decodes onto its GPU).
    The "meta" device, present on every machine, stands in for CUDA: it has shapes but no data,
    so it is used where decoding reads no decoded values back."""
    x = torch.linspace(-1.0, 1.0, 42).reshape(6, 7)[: shape[0]].reshape(shape)
    enc = codec.encode(x, "w")
    dec = codec.decode(enc, TensorSpec.of("w", x), device="meta")
    assert dec.device.type == "meta" and dec.shape == shape and dec.dtype == torch.float32


class _Halves(Codec):
    """A codec of the kind a user may add: every value rounded to a multiple of 1/2, sent as
    float32, and no reconstruction from ``_encode`` (so ``Codec`` decodes its own payload)."""

    codec_id = "test-halves"

    def _encode(self, flat: torch.Tensor, name: str) -> tuple[DensePayload, None]:
        return DensePayload("float32", (torch.round(flat * 2) / 2).numpy().tobytes()), None

    def _decode(self, payload, spec: TensorSpec, device: torch.device) -> torch.Tensor:  # type: ignore[no-untyped-def]
        expect_payload(payload, DensePayload, spec.name)
        return torch.frombuffer(bytearray(payload.data), dtype=torch.float32)[: spec.numel].to(device)


def test_a_codec_without_its_own_reconstruction_gets_the_decoded_one():
    """``encode_with_reconstruction`` (what error feedback calls) decodes the payload when a
    codec's ``_encode`` gives no reconstruction: the receiver's tensor, in the input's shape."""
    x = torch.tensor([[0.2, 0.8, -1.3], [2.6, -0.1, 4.0]])
    enc, recon = _Halves().encode_with_reconstruction(x, "w")
    assert recon.shape == (2, 3) and recon.device == x.device
    assert recon.tolist() == [[0.0, 1.0, -1.5], [2.5, -0.0, 4.0]]
    assert torch.equal(recon, _Halves().decode(enc, TensorSpec.of("w", x)))


STRIDED = [
    ("every-other-column", lambda g: torch.randn(100, 600, generator=g)[:, ::2]),  # a 1-D view of stride 2
    ("transposed", lambda g: torch.randn(300, 400, generator=g).t()),
    ("channels-last", lambda g: torch.randn(8, 16, 5, 5, generator=g).to(memory_format=torch.channels_last)),
]


@pytest.mark.parametrize("codec", [*PLAIN, SBC(0.01, "fast"), STC(0.01, "fast"), Lattice(exponent=-8)], ids=repr)
@pytest.mark.parametrize(("layout", "make"), STRIDED, ids=[s[0] for s in STRIDED])
def test_a_strided_tensor_encodes_as_its_contiguous_copy(codec, layout, make):
    """A view a model hands over (a slice with a step, a transpose, channels-last) is encoded as
    its contiguous copy would be, not refused by a kernel that reads memory in order."""
    x = make(torch.Generator().manual_seed(1))
    assert not x.is_contiguous()
    assert codec.encode(x, "x") == codec.encode(x.contiguous(), "x")
    if isinstance(codec, SBC):
        assert codec.encode_many([("x", x)]) in ([None], [codec.encode(x.contiguous(), "x")])
