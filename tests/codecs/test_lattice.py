"""The lattice codec (fedcomp.codecs.lattice): grid rounding, the value code, hostile payloads, golden bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.codecs import Lattice, TensorSpec, get_codec
from fedcomp.codecs.lattice import K_LIMIT, lattice_exponent
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.wire.payloads import DensePayload, EncodedTensor, STCPayload
from tests.codecs import kit


def seeded(n: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


def test_decodes_to_the_grid_point_of_the_input() -> None:
    x = seeded(5000, 1, 0.01)
    for e in (-12, -8, -4):
        dec, _ = kit.round_trip(Lattice(exponent=e), x)
        h = math.ldexp(1.0, e)
        assert torch.equal(dec, torch.round(x / h) * h)
        assert float((dec - x).abs().max()) <= h / 2


def test_values_of_every_size_round_trip_exactly() -> None:
    k = torch.tensor(
        [0, 1, -1, 2, -2, 3, 7, -8, 255, -256, 1000, K_LIMIT - 1, -(K_LIMIT - 1), 0, 5], dtype=torch.float32
    )
    dec, _ = kit.round_trip(Lattice(exponent=-3), k * 0.125)
    assert torch.equal(dec / 0.125, k)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**20), 2**20), max_size=200), st.integers(-40, 40))
def test_random_integers_round_trip(values: list[int], e: int) -> None:
    k = torch.tensor(values, dtype=torch.float32)
    dec, _ = kit.round_trip(Lattice(exponent=e), k * math.ldexp(1.0, e))
    assert torch.equal(dec, k * math.ldexp(1.0, e))


def test_plus_minus_one_costs_two_bits_and_the_grid_travels_in_the_payload() -> None:
    x = torch.zeros(800)
    x[::8] = torch.tensor([1.0, -1.0] * 50) * 2.0**-10
    enc = Lattice(exponent=-10).encode(x, "w")
    assert isinstance(enc.payload, STCPayload)
    assert enc.payload.nnz == 100 and len(enc.payload.signs) == 26  # k in 5 bits, then 1 sign + 1 unary bit each
    assert lattice_exponent(enc) == -10
    empty = Lattice(exponent=-10).encode(torch.zeros(10), "z")
    assert lattice_exponent(empty) == -10 and empty.payload.nnz == 0  # type: ignore[union-attr]


def test_a_codec_holding_a_grid_rejects_a_payload_on_another() -> None:
    enc = Lattice(exponent=-6).encode(seeded(100, 2, 0.1), "w")
    spec = TensorSpec("w", (100,))
    Lattice(exponent=-6).decode(enc, spec)
    with pytest.raises(PayloadError, match=r"grid step 2\*\*-6 where this replica's grid is 2\*\*-5"):
        Lattice(exponent=-5).decode(enc, spec)


def test_encoding_needs_an_exponent_finite_values_and_the_k_range() -> None:
    with pytest.raises(ValueError, match="exponent"):
        Lattice().encode(seeded(10), "w")
    with pytest.raises(ValueError, match="NaN"):
        Lattice(exponent=0).encode(torch.tensor([1.0, math.nan]), "w")
    with pytest.raises(ValueError, match="2\\*\\*24"):
        Lattice(exponent=0).encode(torch.tensor([float(K_LIMIT)]), "w")


@pytest.mark.parametrize("device", kit.devices())
def test_round_trip_on_devices(device: str) -> None:
    kit.round_trip(Lattice(exponent=-7), seeded(3000, 3, 0.05).reshape(30, 100).to(device))


def test_config_round_trip() -> None:
    for codec in (Lattice(), Lattice(0.25), Lattice(1.0, -9), Lattice(1.0, -9, weight_step=0.5)):
        kit.check_config_round_trip(codec)
    assert get_codec({"id": "lattice", "step": 0.5}) == Lattice(0.5)
    assert Lattice(3.0, weight_step=0.5).with_exponent(-2) == Lattice(3.0, -2, 0.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"step": 0},
        {"step": -1.0},
        {"step": math.inf},
        {"step": True},
        {"exponent": 200},
        {"exponent": 1.5},
        {"weight_step": 0.0},
        {"weight_step": math.nan},
        {"weight_step": "2"},
    ],
)
def test_invalid_config(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=f"lattice: {next(iter(kwargs))} must be"):
        Lattice(**kwargs)


# --- golden fixtures --------------------------------------------------------------------------


def test_golden() -> None:
    kit.check_golden(Lattice(0.5, -9), "e-9-normal4096", seeded(4096, 42, 0.01).reshape(64, 64))
    kit.check_golden(Lattice(0.5, -4), "e-4-sparse1000", (seeded(1000, 43) * (torch.arange(1000) % 7 == 0)))
    kit.check_golden(Lattice(0.5, -20), "e-20-zeros300", torch.zeros(3, 100))
    kit.check_golden(Lattice(0.5, 0), "e0-wide-values", torch.tensor([0, 1, -1, 2, 3, -4, 100, -1000, 65535, 0.0]))


def test_golden_values_decode_to_the_stored_inputs_grid_points() -> None:
    folder = kit.FIXTURES / "lattice" / "v1"
    x = torch.frombuffer(bytearray((folder / "e0-wide-values.input").read_bytes()), dtype=torch.float32)
    from fedcomp.wire import serde

    enc = serde.tensor_from_bytes((folder / "e0-wide-values.bin").read_bytes())
    assert enc.payload.nnz == 8  # type: ignore[union-attr]
    assert torch.equal(Lattice().decode(enc, TensorSpec("e0-wide-values", (10,))), x)


# --- hostile payloads -------------------------------------------------------------------------


def _good() -> tuple[EncodedTensor, TensorSpec]:
    x = torch.zeros(1000)
    x[torch.arange(5, 1000, 100)] = torch.tensor([1.0, -1, 2, -3, 5, 1, 1, -1, 8, 1]) * 2.0**-6
    return Lattice(exponent=-6).encode(x, "layer.w"), TensorSpec("layer.w", (1000,))


def _with(enc: EncodedTensor, **changes: object) -> EncodedTensor:
    p = enc.payload
    assert isinstance(p, STCPayload)
    fields = {"mu": p.mu, "golomb_b": p.golomb_b, "nnz": p.nnz, "bits": p.bits, "signs": p.signs, **changes}
    return EncodedTensor(enc.name, enc.shape, enc.dtype, enc.codec_id, enc.codec_version, STCPayload(**fields))  # type: ignore[arg-type]


def _values(vals: list[int]) -> bytes:
    from fedcomp.codecs.lattice import _pack_values

    return _pack_values(np.array(vals, dtype=np.int64))


def test_bad_payloads_raise_payload_error() -> None:
    enc, spec = _good()
    p = enc.payload
    assert isinstance(p, STCPayload) and p.nnz == 10
    codec = Lattice()
    big = np.zeros(10, dtype=np.uint8)
    cases = {
        "truncated positions": _with(enc, bits=p.bits[:-3]),
        "nnz > numel": _with(enc, nnz=1001),
        "negative nnz": _with(enc, nnz=-1),
        "golomb_b too big": _with(enc, golomb_b=63),
        "values short": _with(enc, signs=p.signs[:2]),
        "values long": _with(enc, signs=p.signs + b"\x00"),
        "values padding": _with(enc, signs=p.signs[:-1] + bytes([p.signs[-1] | 0x01])),
        "values for nnz 0": _with(enc, nnz=0, bits=b""),
        "values empty": _with(enc, signs=b""),
        "no zero in unary": _with(enc, signs=b"\x00\x01" + b"\xff" * 3),
        "rice k above 23": _with(enc, signs=bytes([0xC0]) + p.signs[1:]),
        "a value of 2**24": _with(enc, signs=_values([1] * 9 + [K_LIMIT])),
        "section over the bound": _with(enc, signs=bytes(big) * 7),
        "nan step": _with(enc, mu=math.nan),
        "inf step": _with(enc, mu=math.inf),
        "zero step": _with(enc, mu=0.0),
        "negative step": _with(enc, mu=-p.mu),
        "step not a power of two": _with(enc, mu=0.75),
        "step below 2**-126": _with(enc, mu=2.0**-127),
        "step above 2**103": _with(enc, mu=2.0**104),
        "wrong field types": _with(enc, signs="abc"),
        "wrong payload type": EncodedTensor(
            enc.name, enc.shape, enc.dtype, enc.codec_id, enc.codec_version, DensePayload("float32", b"")
        ),
    }
    assert torch.equal(codec.decode(enc, spec), codec.decode(_with(enc), spec))
    not_on_wire = ("negative nnz", "wrong field types", "wrong payload type")
    reasons = {
        "nnz > numel": "nnz 1001 exceeds the tensor's 1000 elements",
        "values long": f"value section is {len(p.signs) + 1} bytes, its codes need {len(p.signs)}",
        "values padding": "non-zero padding bits after the values",
        "values for nnz 0": f"value section is {len(p.signs)} bytes, more than 0 for nnz 0",
        "no zero in unary": "value section ends inside its unary part",
        "rice k above 23": "Rice parameter 24 exceeds 23",
        "section over the bound": "value section is 70 bytes, more than 34 for nnz 10",
        "a value of 2**24": "a value exceeds |K| < 2**24",
        "step not a power of two": "grid step 0.75 is not a power of two in [2**-126, 2**103]",
    }
    kit.check_rejects(codec, spec, cases, not_on_wire, reasons)


def test_a_hostile_payload_allocates_no_more_than_the_tensor() -> None:
    enc, spec = _good()
    hostile = _with(enc, signs=b"\x00" * 2000)  # far more value bytes than 10 values can need
    with kit.LargestTensor() as seen, pytest.raises(PayloadError):
        Lattice().decode(hostile, spec)
    assert seen.largest <= spec.numel


@pytest.mark.parametrize("seed", range(6))
def test_cpu_path_equals_the_torch_path(seed: int) -> None:
    # The NumPy CPU encoder and the device-generic torch encoder (what CUDA runs) give the same
    # payload and reconstruction: ties at half a step, zeros, large and tiny values, one value.
    gen = torch.Generator().manual_seed(seed)
    n = [1, 7, 1000, 4097, 100_000, 3][seed]
    x = torch.randn(n, generator=gen) * 10 ** (seed - 2)
    x[:: max(1, n // 5)] = 0.0
    e = [-9, -4, -12, 0, -2, 2][seed]
    h = math.ldexp(1.0, e)
    x[1::7] = (torch.randint(-50, 50, x[1::7].shape, generator=gen) + 0.5) * h  # exact half steps
    codec = Lattice(8.0, e)
    cpu = codec._payload_cpu(x.numpy(), "w", h, want_recon=True)
    ref = codec._payload_torch(x, "w", h)
    assert cpu[0] == ref[0]
    assert cpu[1] is not None and torch.equal(cpu[1], ref[1])
    assert codec.encode(x, "w").payload == ref[0]


def test_rice_parameter_is_the_first_cheapest_of_all() -> None:
    from fedcomp.codecs.lattice import _K_MAX, _rice_k

    rng = np.random.default_rng(0)
    for scale in (0, 1, 3, 100, 5000, 2**22):
        m1 = rng.integers(0, scale + 1, 500)
        costs = [int((m1 >> k).sum()) + len(m1) * (k + 1) for k in range(_K_MAX + 1)]
        assert _rice_k(m1) == int(np.argmin(costs)), scale


@pytest.mark.parametrize("bad", ["nan", "inf", "wide", "at the limit"])
def test_cpu_and_torch_paths_refuse_the_same_inputs(bad: str) -> None:
    x = torch.linspace(-1, 1, 2000)
    x[1234] = {"nan": math.nan, "inf": -math.inf, "wide": 2.0**30, "at the limit": -K_LIMIT * 2.0**-4}[bad]
    codec = Lattice(8.0, -4)
    with pytest.raises(ValueError) as cpu:
        codec._payload_cpu(x.numpy(), "w", 2.0**-4, want_recon=False)
    with pytest.raises(ValueError) as ref:
        codec._payload_torch(x, "w", 2.0**-4)
    assert str(cpu.value) == str(ref.value)


def test_cpu_and_torch_paths_take_the_largest_grid_point() -> None:
    """``|K| = 2**24 - 1`` is the last grid point either path takes (one more is refused above)."""
    x = torch.linspace(-1, 1, 2000)
    x[1234] = -(K_LIMIT - 1) * 2.0**-4
    codec = Lattice(8.0, -4)
    cpu = codec._payload_cpu(x.numpy(), "w", 2.0**-4, want_recon=True)
    ref = codec._payload_torch(x, "w", 2.0**-4)
    assert cpu[0] == ref[0] and cpu[1] is not None and float(ref[1][1234]) == float(x[1234])
