import numpy as np
import pytest
import torch

from fedcomp.codecs import TensorSpec, get_codec
from fedcomp.codecs.gradiveq import GradiVeQ, coefficients_of
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.methods.gradiveq import Basis, Compressor, fit_compressor
from fedcomp.wire import serde
from fedcomp.wire.payloads import DensePayload, EncodedTensor, GradiVeQPayload
from tests.codecs import kit

D, K = 16, 4


def hadamard(n):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def fixed_compressor(names=("span-7x9", "offspan-40x25", "t"), version=3, seed=2018):
    """A seeded compressor whose entries are dyadic (U = +-1/4: a signed, permuted Hadamard
    basis; mu = multiples of 1/8), so on dyadic inputs every float32 product and sum is exact and
    the golden bytes do not depend on the BLAS's summation order."""
    g = torch.Generator().manual_seed(seed)
    cols = torch.randperm(D, generator=g)[:K]
    signs = torch.randint(0, 2, (K,), generator=g) * 2 - 1
    u = (hadamard(D)[:, cols] * signs / 4).to(torch.float32)
    mu = (torch.randint(-8, 9, (D,), generator=g) / 8).to(torch.float32)
    return Compressor(version, {n: Basis(u, mu) for n in names})


def in_span(comp, name, numel, seed):
    """Dyadic values mu + U c (c multiples of 1/4): reconstructed exactly."""
    b = comp.basis(name)
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(-16, 17, (-(-numel // D), K), generator=g).to(torch.float32) / 4
    return (c @ b.basis.t() + b.whitening).reshape(-1)[:numel]


def dyadic(numel, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-64, 65, (numel,), generator=g).to(torch.float32) / 64


COMP = fixed_compressor()
CODEC = GradiVeQ(COMP)


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", kit.devices())
@pytest.mark.parametrize("shape", [(7, 9), (8, 10), (40, 24), (16,), (3, 4, 16), (3, 5, 11)])
def test_round_trip_in_span_is_exact(shape, device):
    n = int(np.prod(shape))
    x = in_span(COMP, "t", n, seed=n).reshape(shape).to(device)
    dec, recon = kit.round_trip(CODEC, x, "t")
    # full slices in the span come back exactly; the zero-padded last slice of a ragged tensor
    # is not in the span (its padding is 0, not what U c + mu has there)
    full = n // D * D
    torch.testing.assert_close(dec.reshape(-1)[:full], x.reshape(-1)[:full], rtol=0, atol=1e-6)


@pytest.mark.parametrize("device", kit.devices())
def test_round_trip_of_a_fitted_compressor_is_the_projection(device):
    g = torch.Generator().manual_seed(0)
    ups = [torch.randn(64, 100, generator=g) for _ in range(6)]
    comp = fit_compressor({"w": [u.reshape(-1) for u in ups]}, 1, 100, eps=0.6)
    b = comp.basis("w")
    x = ups[0].to(device)
    dec, _ = kit.round_trip(GradiVeQ(comp), x, "w")
    proj = (x - b.whitening.to(device)) @ b.basis.to(device) @ b.basis.t().to(device) + b.whitening.to(device)
    torch.testing.assert_close(dec, proj, rtol=0, atol=1e-5)
    enc = GradiVeQ(comp).encode(x, "w")
    assert len(enc.payload.coefficients) == 64 * b.dim * 4  # 100 / k times smaller than dense


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes(dtype):
    x = in_span(COMP, "t", 100, 5).to(dtype)
    dec, _ = kit.round_trip(CODEC, x, "t")
    assert dec.dtype == dtype


def test_uncovered_tensors_and_non_finite_values_cannot_be_encoded():
    with pytest.raises(ValueError, match="'other'.*dense"):
        CODEC.encode(torch.zeros(100), "other")
    x = in_span(COMP, "t", 100, 1)
    x[37] = float("nan")
    with pytest.raises(ValueError, match="'t'"):
        CODEC.encode(x, "t")
    x[37] = float("inf")
    with pytest.raises(ValueError, match="'t'"):
        CODEC.encode(x, "t")


def test_coefficients_of_returns_what_the_codec_decodes_from():
    x = dyadic(63, 3).reshape(7, 9)
    enc = serde.tensor_from_bytes(serde.tensor_to_bytes(CODEC.encode(x, "t")))
    spec = TensorSpec.of("t", x)
    c = coefficients_of(enc, spec, COMP)
    assert c.shape == (4, K) and c.dtype == torch.float32
    b = COMP.basis("t")
    torch.testing.assert_close(
        (c @ b.basis.t() + b.whitening).reshape(-1)[:63], CODEC.decode(enc, spec).reshape(-1), rtol=0, atol=0
    )


def test_coefficients_of_puts_them_on_the_device_asked_for():
    """The server sums coefficients where it aggregates: they land on the device it names (the
    "meta" device, present on every machine, stands in for CUDA here), and on the CPU by default."""
    enc, spec = _good()
    assert coefficients_of(enc, spec, COMP).device == torch.device("cpu")
    assert coefficients_of(enc, spec, COMP, device="cpu").device == torch.device("cpu")
    on_meta = coefficients_of(enc, spec, COMP, device="meta")
    assert on_meta.device.type == "meta" and on_meta.shape == (4, K) and on_meta.dtype == torch.float32
    # and the decoder builds the tensor there, basis and all
    dec = CODEC.decode(enc, spec, device="meta")
    assert dec.device.type == "meta" and dec.shape == (7, 9)


# --- config ---------------------------------------------------------------------------------------


def test_config_identifies_the_compressor():
    cfg = CODEC.get_config()
    assert cfg == {"id": "gradiveq", "compressor_version": 3, "compressor_digest": COMP.digest}
    assert GradiVeQ.from_config(cfg, compressor=COMP) == CODEC
    assert GradiVeQ(fixed_compressor()) == CODEC  # equal by content
    assert GradiVeQ(fixed_compressor(seed=1)) != CODEC
    assert GradiVeQ(fixed_compressor(version=4)) != CODEC
    assert repr(CODEC).startswith("GradiVeQ(compressor_version=3")


def test_config_alone_is_not_enough():
    for cfg in ("gradiveq", {"id": "gradiveq"}, CODEC.get_config()):
        with pytest.raises(ConfigError, match="^compressor:"):
            get_codec(cfg)
    with pytest.raises(ConfigError) as info:
        GradiVeQ.from_config({"id": "gradiveq"})
    assert str(info.value) == (  # the message says how to build one
        "compressor: gradiveq cannot be built from a config alone; its basis is a runtime parameter: "
        "use GradiVeQ(compressor) or GradiVeQ.from_config(config, compressor=...)"
    )
    with pytest.raises(ConfigError, match="^compressor:"):
        GradiVeQ("not a compressor")  # type: ignore[arg-type]


def test_config_must_match_the_compressor_given():
    other = fixed_compressor(seed=7)
    with pytest.raises(ConfigError, match="^compressor_digest:"):
        GradiVeQ.from_config(CODEC.get_config(), compressor=other)
    with pytest.raises(ConfigError, match="^compressor_version:"):
        GradiVeQ.from_config(CODEC.get_config(), compressor=fixed_compressor(version=9))
    with pytest.raises(ConfigError, match="unknown"):
        GradiVeQ.from_config({"id": "gradiveq", "p": 0.1}, compressor=COMP)
    with pytest.raises(ConfigError, match="^id:"):
        GradiVeQ.from_config({"id": "sbc"}, compressor=COMP)


# --- golden fixtures ------------------------------------------------------------------------------


def test_golden(monkeypatch):
    """kit.check_golden rebuilds the codec from the stored config, which needs the compressor:
    give it the fixed one (stored next to the fixtures as compressor.bin, also frozen)."""
    folder = kit.FIXTURES / "gradiveq" / "v1"
    stored = folder / "compressor.bin"
    wire = serde.compressor_to_bytes(COMP.to_wire())
    if not stored.exists():
        assert kit.REGEN, f"golden fixture {stored} is missing; run with FEDCOMP_WRITE_FIXTURES=1"
        folder.mkdir(parents=True, exist_ok=True)
        stored.write_bytes(wire)
    assert stored.read_bytes() == wire, "the fixed compressor's wire bytes changed"
    specs = [TensorSpec("span-7x9", (7, 9)), TensorSpec("offspan-40x25", (40, 25)), TensorSpec("t", (16,))]
    from_file = Compressor.from_wire(serde.compressor_from_bytes(stored.read_bytes()), specs)
    monkeypatch.setattr(kit, "get_codec", lambda cfg: GradiVeQ.from_config(cfg, compressor=from_file))
    kit.check_golden(CODEC, "span-7x9", in_span(COMP, "span-7x9", 63, 11).reshape(7, 9))
    kit.check_golden(CODEC, "offspan-40x25", dyadic(1000, 12).reshape(40, 25))


# --- hostile payloads -----------------------------------------------------------------------------


def _good():
    x = dyadic(63, 21).reshape(7, 9)
    return CODEC.encode(x, "t"), TensorSpec("t", (7, 9))


def _with(enc, **changes):
    p = enc.payload
    fields = {
        "compressor_version": p.compressor_version,
        "slice_size": p.slice_size,
        "dim": p.dim,
        "coefficients": p.coefficients,
        **changes,
    }
    return EncodedTensor(enc.name, enc.shape, enc.dtype, enc.codec_id, enc.codec_version, GradiVeQPayload(**fields))


def test_bad_payloads_raise_payload_error():
    enc, spec = _good()
    data = enc.payload.coefficients
    nan = bytearray(data)
    nan[8:12] = np.float32(np.nan).tobytes()
    inf = bytearray(data)
    inf[-4:] = np.float32(-np.inf).tobytes()
    cases = {
        "old version": _with(enc, compressor_version=2),
        "newer version": _with(enc, compressor_version=4),
        "slice size": _with(enc, slice_size=8),
        "dim": _with(enc, dim=5),
        "dim zero": _with(enc, dim=0),
        "truncated": _with(enc, coefficients=data[:-4]),
        "trailing": _with(enc, coefficients=data + b"\0\0\0\0"),
        "odd length": _with(enc, coefficients=data[:-1]),
        "nan": _with(enc, coefficients=bytes(nan)),
        "inf": _with(enc, coefficients=bytes(inf)),
        "huge dim": _with(enc, dim=2**31, coefficients=b""),
        "not covered": EncodedTensor("t2", enc.shape, enc.dtype, enc.codec_id, enc.codec_version, enc.payload),
        "wrong payload type": EncodedTensor(
            enc.name, enc.shape, enc.dtype, enc.codec_id, enc.codec_version, DensePayload("float32", b"")
        ),
    }
    # 63 values in slices of 16: 4 slices of K = 4 float32 coefficients, 64 bytes
    reasons = {
        "old version": "coefficients are for compressor version 2, this is version 3",
        "newer version": "coefficients are for compressor version 4, this is version 3",
        "slice size": "slice_size 8 / dim 4 where the compressor has 16 / 4",
        "dim": "slice_size 16 / dim 5 where the compressor has 16 / 4",
        "dim zero": "slice_size 16 / dim 0 where the compressor has 16 / 4",
        "truncated": "coefficients are 60 bytes, expected ceil(numel/d)*k*4 = 64",
        "trailing": "coefficients are 68 bytes, expected ceil(numel/d)*k*4 = 64",
        "odd length": "coefficients are 63 bytes, expected ceil(numel/d)*k*4 = 64",
        "nan": "coefficients hold NaN or infinite values",
        "inf": "coefficients hold NaN or infinite values",
        "huge dim": f"slice_size 16 / dim {2**31} where the compressor has 16 / 4",
        "not covered": "compressor version 3 does not compress this tensor",
        "wrong payload type": "payload is DensePayload, expected GradiVeQPayload",
    }
    torch.testing.assert_close(CODEC.decode(enc, spec), CODEC.decode(_with(enc), spec), rtol=0, atol=0)
    for why, bad in cases.items():
        target = TensorSpec(bad.name, spec.shape)
        for fn in (lambda e, s: CODEC.decode(e, s), lambda e, s: coefficients_of(e, s, COMP)):
            with pytest.raises(PayloadError) as info:
                fn(bad, target)
            assert (info.value.tensor, info.value.reason) == (bad.name, reasons[why]), why
            if why != "wrong payload type":  # and through real protobuf bytes
                with pytest.raises(PayloadError):
                    fn(serde.tensor_from_bytes(serde.tensor_to_bytes(bad)), target)


@pytest.mark.parametrize(
    "field, value",
    [("compressor_version", "3"), ("slice_size", 16.0), ("dim", True), ("coefficients", "0000")],
)
def test_payload_fields_of_the_wrong_type(field, value):
    """What a caller building payloads in Python (not from protobuf) can get wrong."""
    enc, spec = _good()
    for fn in (CODEC.decode, lambda e, s: coefficients_of(e, s, COMP)):
        with pytest.raises(PayloadError) as info:
            fn(_with(enc, **{field: value}), spec)
        assert (info.value.tensor, info.value.reason) == ("t", "GradiVeQ payload fields have the wrong types")


def test_coefficients_of_checks_the_envelope():
    enc, spec = _good()
    for bad, s in [
        (enc, TensorSpec("other", (7, 9))),
        (enc, TensorSpec("t", (9, 7))),
        (enc, TensorSpec("t", (7, 9), torch.float16)),
        (EncodedTensor("t", enc.shape, enc.dtype, "sbc", 1, enc.payload), spec),
        (EncodedTensor("t", enc.shape, enc.dtype, "gradiveq", 2, enc.payload), spec),
    ]:
        with pytest.raises(PayloadError):
            coefficients_of(bad, s, COMP)
        with pytest.raises(PayloadError):
            CODEC.decode(bad, s)
