"""The methods contract for updates that were not aggregated (``client_keeps_sent``,
``client_recover``) and the encoder pieces it rests on: what the encoder says it sent is what the
server decodes, and a small (dense) tensor that has a residual sends it."""

from __future__ import annotations

import pytest
import torch

from fedcomp.codecs import SBC, DenseFP32, get_codec
from fedcomp.methods.base import UplinkMethod
from fedcomp.methods.registry import UPLINKS
from fedcomp.methods.sent import KeptValues
from fedcomp.methods.sent import dense as to_dense
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(50, 40, generator=g), "b": torch.randn(10, generator=g)}


@pytest.mark.parametrize("method_id", sorted(UPLINKS))
def test_every_method_states_whether_it_keeps_what_it_sent(method_id: str) -> None:
    method = UPLINKS[method_id]
    # With residuals off (the run's error-feedback = false) nobody keeps anything.
    assert method.client_keeps_sent(False) is False
    # With them on: every method that keeps residuals, except GradiVeQ (none: its own choice).
    assert method.client_keeps_sent(method.error_feedback) is (method_id != "gradiveq" and method.error_feedback)


def test_gradiveq_says_no_explicitly() -> None:
    assert UPLINKS["gradiveq"].client_keeps_sent(True) is False
    assert UPLINKS["gradiveq"].client_keeps_sent is not UplinkMethod.client_keeps_sent


def test_client_recover_adds_the_lost_update_to_the_residual() -> None:
    residual = {"w": torch.full((3,), 0.5)}
    lost = {"w": torch.tensor([1.0, 0.0, -1.0]), "b": torch.tensor([2.0])}
    out = UplinkMethod.client_recover(lost, residual)
    assert torch.equal(out["w"], torch.tensor([1.5, 0.5, -0.5]))
    assert torch.equal(out["b"], torch.tensor([2.0]))  # no residual before: the update itself
    assert torch.equal(residual["w"], torch.full((3,), 0.5))  # the input is not modified
    lost["b"] += 1
    assert torch.equal(out["b"], torch.tensor([2.0]))  # nor aliased


@pytest.mark.parametrize("sparse_sent", [False, True])
@pytest.mark.parametrize("codec_config", [{"id": "sbc", "p": 0.05}, {"id": "topk", "p": 0.02}, {"id": "dense-fp16"}])
def test_what_the_encoder_says_it_sent_is_what_the_receiver_decodes(codec_config: dict, sparse_sent: bool) -> None:
    model = _model()
    codec = get_codec(codec_config)
    enc = UpdateEncoder(codec, min_numel=100)
    enc.load_state_dict({"w": torch.randn(50, 40) * 0.1})
    update = enc.encode(model, keep_sent=True, sparse_sent=sparse_sent)
    assert enc.sent is not None
    decoded = decode_update(update, specs_of(model), [codec, DenseFP32()])
    for k in model:
        assert torch.equal(to_dense(enc.sent[k]), decoded[k]), k
    # Said sparsely exactly where asked and SBC or top-k coded the tensor (the small one goes dense).
    assert isinstance(enc.sent["w"], KeptValues) == (sparse_sent and codec_config["id"] in ("sbc", "topk"))
    assert not isinstance(enc.sent["b"], KeptValues)
    enc.encode(model)
    assert enc.sent is None


@pytest.mark.parametrize("error_feedback", [True, False])
@pytest.mark.parametrize(
    "codec_config",
    [
        {"id": "sbc", "p": 0.05},
        {"id": "sbc", "p": 0.3, "mode": "exact"},
        {"id": "stc", "p": 0.05},
        {"id": "topk", "p": 0.3, "values": "float16"},
    ],
)
def test_sent_kept_sparsely_changes_no_byte_and_no_residual(codec_config: dict, error_feedback: bool) -> None:
    """Round after round, ``sparse_sent`` gives the bytes, the residuals and (made dense) the
    reconstructions of ``keep_sent`` alone, bit for bit; the pending record written from them is
    the same record."""
    from fedcomp.flower.pending import PendingUpdate

    codec = get_codec(codec_config)
    dense_enc, sparse_enc = (UpdateEncoder(codec, min_numel=100, error_feedback=error_feedback) for _ in range(2))
    g = torch.Generator().manual_seed(7)
    for rnd in range(4):
        model = {
            "w": torch.randn(50, 40, generator=g) * 0.1,
            "b": torch.randn(10, generator=g),
            "v": torch.randn(3000, generator=g),
        }
        want = dense_enc.encode_to_bytes(model, rnd, keep_sent=True)
        got = sparse_enc.encode_to_bytes(model, rnd, keep_sent=True, sparse_sent=True)
        assert got == want, rnd
        assert dense_enc.sent is not None and sparse_enc.sent is not None
        assert list(sparse_enc.sent) == list(dense_enc.sent)
        for k, t in dense_enc.sent.items():
            assert to_dense(sparse_enc.sent[k]).numpy().tobytes() == t.numpy().tobytes(), (rnd, k)
        assert isinstance(sparse_enc.sent["v"], KeptValues)
        res_a, res_b = dense_enc.state_dict(), sparse_enc.state_dict()
        assert list(res_a) == list(res_b) and all(torch.equal(res_a[k], res_b[k]) for k in res_a)
        assert PendingUpdate(rnd, sparse_enc.sent).to_record() == PendingUpdate(rnd, dense_enc.sent).to_record()


def test_a_small_tensor_with_a_residual_sends_it_and_keeps_a_zero_one() -> None:
    model = _model()
    enc = UpdateEncoder(SBC(p=0.05), min_numel=100)
    enc.load_state_dict({"b": torch.ones(10)})
    update = enc.encode(model, keep_sent=True)
    decoded = decode_update(update, specs_of(model), [SBC(p=0.05), DenseFP32()])
    torch.testing.assert_close(decoded["b"], model["b"] + 1, rtol=0, atol=1e-6)
    assert float(enc.state_dict()["b"].abs().max()) <= 1e-6
    # Without a residual a small tensor keeps none (as before): no "b" in the state.
    enc2 = UpdateEncoder(SBC(p=0.05), min_numel=100)
    enc2.encode(model)
    assert set(enc2.state_dict()) == {"w"}
