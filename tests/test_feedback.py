import pytest
import torch

from fedcomp.codecs import DenseFP16, DenseFP32, Identity, TensorSpec
from fedcomp.errors import PayloadError
from fedcomp.methods.feedback import ErrorFeedback
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.wire.serde import update_from_bytes, update_to_bytes


def test_residual_is_what_the_message_lacked():
    fb = ErrorFeedback(DenseFP16())
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    enc = fb.encode(x, "w")
    dec = DenseFP16().decode(enc, TensorSpec("w", (1000,)))
    torch.testing.assert_close(fb.residual("w"), x - dec, rtol=0, atol=0)
    # the next round sends the residual along with the new tensor
    enc2 = fb.encode(torch.zeros(1000), "w")
    dec2 = DenseFP16().decode(enc2, TensorSpec("w", (1000,)))
    torch.testing.assert_close(dec + dec2, x, rtol=0, atol=1e-6)


def test_sum_of_decoded_tracks_sum_of_inputs():
    """With error feedback, what was sent over many rounds equals what was fed in, up to one residual."""
    fb, gen = ErrorFeedback(DenseFP16()), torch.Generator().manual_seed(2)
    total_in, total_out = torch.zeros(500), torch.zeros(500)
    for _ in range(20):
        x = torch.randn(500, generator=gen) * 1e-3
        total_in += x
        total_out += DenseFP16().decode(fb.encode(x, "w"), TensorSpec("w", (500,)))
    torch.testing.assert_close(total_out + fb.residual("w"), total_in, rtol=0, atol=1e-6)


def test_state_dict_round_trip():
    fb = ErrorFeedback(DenseFP16())
    fb.encode(torch.randn(10), "a")
    fb2 = ErrorFeedback(DenseFP16())
    fb2.load_state_dict(fb.state_dict())
    assert torch.equal(fb2.residual("a"), fb.residual("a"))
    with pytest.raises(ValueError, match="shape"):
        fb2.encode(torch.randn(11), "a")


def test_update_round_trip_and_small_tensors_dense():
    tensors = {"big": torch.randn(50, 40), "bias": torch.randn(40)}
    enc = UpdateEncoder(DenseFP16(), min_numel=100)
    upd = update_from_bytes(update_to_bytes(enc.encode(tensors, base_model_version=3)))
    assert upd.base_model_version == 3
    assert [t.codec_id for t in upd.tensors] == ["dense-fp16", "dense-fp32"]
    out = decode_update(upd, specs_of(tensors), [DenseFP16(), DenseFP32()])
    assert torch.equal(out["bias"], tensors["bias"])
    torch.testing.assert_close(out["big"], tensors["big"], atol=1e-2, rtol=1e-3)


def test_decode_update_rejects_wrong_structure():
    tensors = {"a": torch.randn(4), "b": torch.randn(4)}
    upd = UpdateEncoder(Identity(), min_numel=0).encode(tensors)
    specs = specs_of(tensors)
    with pytest.raises(PayloadError, match="expected 1"):
        decode_update(upd, specs[:1], [Identity()])
    with pytest.raises(PayloadError, match="tensor 'b': found tensor 'a'"):
        decode_update(upd, specs[::-1], [Identity()])
    with pytest.raises(PayloadError, match="not accepted"):
        decode_update(upd, specs, [DenseFP32()])
