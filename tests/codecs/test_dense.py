import pytest
import torch

from fedcomp.codecs import DenseFP16, DenseFP32, Identity, TensorSpec
from fedcomp.errors import PayloadError
from fedcomp.wire import serde
from fedcomp.wire.payloads import DensePayload, EncodedTensor, SBCPayload
from tests.codecs import kit


@pytest.mark.parametrize("device", kit.devices())
@pytest.mark.parametrize("codec", [DenseFP32(), DenseFP16(), Identity()], ids=lambda c: c.codec_id)
def test_round_trip(codec, device):
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(0)).to(device)
    dec, _ = kit.round_trip(codec, x)
    tol = 1e-3 if codec.codec_id == "dense-fp16" else 0.0
    torch.testing.assert_close(dec, x, rtol=tol, atol=tol)


def test_identity_keeps_float64_bits():
    x = torch.randn(33, dtype=torch.float64)
    dec, _ = kit.round_trip(Identity(), x)
    assert torch.equal(dec, x)


@pytest.mark.parametrize("codec", [DenseFP32(), DenseFP16(), Identity()], ids=lambda c: c.codec_id)
def test_config_round_trip(codec):
    kit.check_config_round_trip(codec)


@pytest.mark.parametrize("codec", [DenseFP32(), DenseFP16()], ids=lambda c: c.codec_id)
def test_golden(codec):
    x = torch.linspace(-3, 3, 257).reshape(1, 257)
    kit.check_golden(codec, "linspace257", x)


def test_bad_inputs_raise_payload_error():
    c, spec = DenseFP32(), TensorSpec("w", (4, 4))
    good = c.encode(torch.ones(4, 4), "w")
    cases = {
        "truncated": DensePayload("float32", good.payload.data[:-1]),  # type: ignore[union-attr]
        "wrong encoding": DensePayload("float16", b"\0" * 32),
        "not dense": SBCPayload(1.0, 0, 0, b""),
    }
    reasons = {  # exactly what the server logs
        "truncated": "dense data is 63 bytes, expected 64",
        "wrong encoding": "dense encoding 'float16' where 'float32' was expected",
        "not dense": "payload is SBCPayload, expected DensePayload",
    }
    for why, payload in cases.items():
        bad = EncodedTensor("w", (4, 4), "float32", "dense-fp32", 1, payload)
        with pytest.raises(PayloadError) as info:
            c.decode(bad, spec)
        assert (info.value.tensor, info.value.reason) == ("w", reasons[why])
    # the identity codec expects the tensor's own dtype, fp16 its half floats
    with pytest.raises(PayloadError) as info:
        Identity().decode(Identity().encode(torch.ones(2, dtype=torch.float64), "d"), TensorSpec("d", (2,)))
    assert info.value.reason == "dtype float64 where float32 was expected"
    half = EncodedTensor("h", (2,), "float32", "dense-fp16", 1, DensePayload("float32", b"\0" * 8))
    with pytest.raises(PayloadError) as info:
        DenseFP16().decode(half, TensorSpec("h", (2,)))
    assert info.value.reason == "dense encoding 'float32' where 'float16' was expected"
    for field, value, msg in [
        ("shape", (4, 5), "shape"),
        ("dtype", "float16", "dtype"),
        ("codec_id", "sbc", "codec"),
        ("name", "v", "for tensor"),
        ("codec_version", 9, "version"),
    ]:
        kwargs = {**good.__dict__, field: value}
        with pytest.raises(PayloadError, match=msg):
            c.decode(EncodedTensor(**kwargs), spec)


def test_garbage_protobuf_is_payload_error():
    with pytest.raises(PayloadError):
        serde.tensor_from_bytes(b"\xff\xff\xff\xff")
    with pytest.raises(PayloadError):
        serde.update_from_bytes(b"\x08\x07")  # format_version = 7


@pytest.mark.parametrize("codec", [DenseFP32(), DenseFP16(), Identity()], ids=lambda c: c.codec_id)
@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0, 2)])
def test_empty_tensors(codec, shape):
    """A tensor with no elements is an empty payload, and decodes to its shape (torch.frombuffer
    refuses an empty buffer, so this is a path of its own)."""
    x = torch.zeros(shape)
    enc = codec.encode(x, "e")
    assert enc.payload.data == b""  # type: ignore[union-attr]
    dec, _ = kit.round_trip(codec, x, "e")
    assert dec.shape == shape


@pytest.mark.parametrize("codec", [DenseFP32(), DenseFP16()], ids=lambda c: c.codec_id)
def test_lossy_dense_codecs_reconstruct_in_float32(codec):
    """What error feedback subtracts: the float32 reconstruction of the wire values, whatever
    the input's float dtype (the identity codec alone keeps the tensor's own)."""
    x = torch.linspace(-1, 1, 9, dtype=torch.float64)
    enc, recon = codec.encode_with_reconstruction(x, "d")
    assert recon.dtype == torch.float32
    assert torch.equal(recon, x.to(torch.float16 if codec.codec_id == "dense-fp16" else torch.float32).float())
    assert Identity().encode_with_reconstruction(x, "d")[1].dtype == torch.float64
