import pytest
import torch

from fedcomp.codecs import SBC, STC, DenseFP16, DenseFP32, Identity, TensorSpec, ThreeLC, TopK
from fedcomp.errors import PayloadError
from fedcomp.methods.feedback import ErrorFeedback, StaleResidual
from fedcomp.methods.sent import KeptValues
from fedcomp.methods.sent import dense as to_dense
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


@pytest.mark.parametrize("shape", [(), (1,), (0,), (3, 1)], ids=str)
def test_a_residual_of_any_shape_is_added(shape: tuple[int, ...]) -> None:
    """0-d (BatchNorm's ``num_batches_tracked``), one-value and empty tensors carry a residual as
    any other: NumPy adds two 0-d arrays into a scalar, which must not reach ``torch.from_numpy``."""
    fb = ErrorFeedback(DenseFP16())
    fb.load_state_dict({"t": torch.full(shape, 0.25)})
    x = torch.full(shape, 1.0 + 2.0**-12)  # float16 rounds it to 1.0: the residual stays 0.25 + 2**-12
    dec = DenseFP16().decode(fb.encode(x, "t"), TensorSpec("t", shape))
    assert dec.shape == shape and torch.equal(dec, torch.full(shape, 1.25))
    assert torch.equal(fb.residual("t"), torch.full(shape, 2.0**-12))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize(
    "codec",
    [SBC(p=0.01), ThreeLC(), TopK(p=0.01), STC(p=0.01), DenseFP16(), Identity()],
    ids=lambda c: c.codec_id,
)
def test_a_non_float32_model_decodes_with_its_own_specs(codec, dtype) -> None:
    """Error feedback computes in float32 but encodes in the model's dtype, so the update says
    that dtype for every tensor (large ones through the residual, small ones plain) and decodes
    with ``specs_of(model)``; what was sent plus the residual is what was fed in."""
    gen = torch.Generator().manual_seed(5)
    enc = UpdateEncoder(codec, min_numel=100)
    total_in = {"a.weight": torch.zeros(5000, dtype=torch.float64)}
    total_out = torch.zeros(5000, dtype=torch.float64)
    for _ in range(3):
        model = {
            "a.weight": torch.randn(5000, generator=gen).to(dtype),
            "c.bias": torch.randn(10, generator=gen).to(dtype),
        }
        specs = specs_of(model)
        out = decode_update(update_from_bytes(enc.encode_to_bytes(model), specs), specs, [codec, DenseFP32()])
        assert {k: v.dtype for k, v in out.items()} == {k: dtype for k in model}
        total_in["a.weight"] += model["a.weight"].to(torch.float64)
        total_out += out["a.weight"].to(torch.float64)
    residual = enc.feedback.residual("a.weight").to(torch.float64)
    torch.testing.assert_close(total_out + residual, total_in["a.weight"], rtol=0, atol=1e-4)


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


def _sent_with_residual(stale: StaleResidual | None, age: int, fresh: torch.Tensor, residual: torch.Tensor):
    """What a lossless codec sends for ``fresh`` when ``residual`` waited ``age`` rounds."""
    fb = ErrorFeedback(Identity(), stale=stale)
    fb.load_state_dict({"w": residual})
    fb.age = age
    enc = fb.encode(fresh, "w")
    return Identity().decode(enc, TensorSpec("w", tuple(fresh.shape)))


def test_stale_residual_decays_per_round_of_waiting_beyond_the_first():
    gen = torch.Generator().manual_seed(3)
    fresh, residual = torch.randn(100, generator=gen), torch.randn(100, generator=gen)
    policy = StaleResidual(decay=0.5)
    # A client that sends every round (age 1) keeps its whole residual; one away 3 rounds, a quarter.
    torch.testing.assert_close(_sent_with_residual(policy, 1, fresh, residual), fresh + residual)
    torch.testing.assert_close(_sent_with_residual(policy, 3, fresh, residual), fresh + 0.25 * residual)
    # The default policy (and none) is the classic rule, whatever the age.
    for off in (StaleResidual(), None):
        torch.testing.assert_close(_sent_with_residual(off, 10, fresh, residual), fresh + residual)


def test_stale_residual_clip_bounds_its_norm_against_the_fresh_update():
    gen = torch.Generator().manual_seed(4)
    fresh = torch.randn(100, generator=gen)
    big = 10 * fresh.norm() * torch.nn.functional.normalize(torch.randn(100, generator=gen), dim=0)
    sent = _sent_with_residual(StaleResidual(clip=2.0), 5, fresh, big)
    kept = sent - fresh
    assert float(kept.norm()) == pytest.approx(2.0 * float(fresh.norm()), rel=1e-5)
    assert float(torch.nn.functional.cosine_similarity(kept, big, dim=0)) == pytest.approx(1.0, abs=1e-6)
    small = 0.5 * big / 10  # within the bound: untouched
    torch.testing.assert_close(_sent_with_residual(StaleResidual(clip=2.0), 5, fresh, small), fresh + small)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"decay": 0.0}, "stale-residual-decay: 0.0 is outside"),
        ({"decay": 1.5}, "stale-residual-decay: 1.5 is outside"),
        ({"clip": -1.0}, "stale-residual-clip: -1.0"),
        ({"clip": float("nan")}, "stale-residual-clip: nan"),
    ],
)
def test_stale_residual_rejects_bad_settings(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StaleResidual(**kwargs)


def test_stale_residual_age_is_at_least_one():
    with pytest.raises(ValueError, match="age is at least 1"):
        StaleResidual(decay=0.9).apply(torch.ones(2), torch.ones(2), 0)


@pytest.mark.parametrize(
    "config", [{"id": "sbc", "p": 0.05}, {"id": "3lc", "s": 1.0}, {"id": "dense-fp32"}, {"id": "dense-fp16"}]
)
def test_cpu_residuals_equal_the_plain_formula_and_leave_inputs_alone(config) -> None:
    # The CPU path adds and subtracts in NumPy, updating its own accumulator in place: the
    # residuals must be bit for bit ``acc + r`` then ``acc - recon``, and neither the caller's
    # tensors nor a residual handed out by state_dict() may change under a later encode.
    from fedcomp.codecs import get_codec

    codec = get_codec(config)
    fb = ErrorFeedback(codec)
    gen = torch.Generator().manual_seed(3)
    residual: dict[str, torch.Tensor] = {}
    for _ in range(4):
        x = torch.randn(40, 130, generator=gen)
        before = x.clone()
        held = fb.state_dict()
        held_copy = {k: v.clone() for k, v in held.items()}
        _, recon = fb.encode_with_reconstruction(x, "w")
        acc = x + residual["w"] if "w" in residual else x.clone()
        residual["w"] = acc - recon
        assert torch.equal(x, before)
        assert all(torch.equal(held[k], held_copy[k]) for k in held)
        assert torch.equal(fb.residual("w"), residual["w"])


@pytest.mark.parametrize(
    "config",
    [
        {"id": "sbc", "p": 0.05},
        {"id": "sbc", "p": 0.01, "mode": "exact"},
        {"id": "stc", "p": 0.05},
        {"id": "topk", "p": 0.03},
        {"id": "topk", "p": 0.03, "values": "float16"},
        {"id": "3lc", "s": 1.0},
        {"id": "dense-fp16"},
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_encoding_without_the_reconstruction_keeps_the_same_residuals(config, dtype) -> None:
    # SBC, STC and top-k take their values off the residual at the kept positions instead of
    # subtracting a dense reconstruction (the others go the dense way): encodings and residuals bit for bit those of
    # encode_with_reconstruction, round after round, from the first (no residual: the caller's
    # tensor must stay as it was) on, also with the stale-residual remedy on.
    from fedcomp.codecs import get_codec

    codec = get_codec(config)
    for stale in (None, StaleResidual(decay=0.5)):
        sparse, dense, kept = ErrorFeedback(codec, stale), ErrorFeedback(codec, stale), ErrorFeedback(codec, stale)
        gen = torch.Generator().manual_seed(5)
        for rnd in range(4):
            sparse.age = dense.age = kept.age = rnd + 1
            x = (torch.randn(40, 130, generator=gen) * 1e-2).to(dtype)
            before = x.clone()
            held = sparse.state_dict()
            held_copy = {k: v.clone() for k, v in held.items()}
            got, none = sparse.encode_without_reconstruction(x, "w")
            want, recon = dense.encode_with_reconstruction(x, "w")
            also, sent = kept.encode_with_kept_values(x, "w")
            assert none is None and got == want and also == want, (rnd, stale)
            # What the receiver decodes, said sparsely for SBC: the reconstruction, bit for bit.
            assert isinstance(sent, KeptValues) == (config["id"] in ("sbc", "stc", "topk"))
            assert to_dense(sent).numpy().tobytes() == recon.numpy().tobytes(), (rnd, stale)
            assert torch.equal(x, before)
            assert all(torch.equal(held[k], held_copy[k]) for k in held)
            a, b, c = sparse.residual("w"), dense.residual("w"), kept.residual("w")
            assert a is not None and b is not None and c is not None
            assert a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes(), (rnd, stale)
            assert c.numpy().tobytes() == b.numpy().tobytes(), (rnd, stale)
