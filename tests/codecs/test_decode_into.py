"""``Codec.decode_into`` and ``decode_update(out=...)``: decoding into a receiver's own buffers
gives bit for bit what ``decode`` gives, whatever the buffer held before, with the C kernels and
with the NumPy paths; the same errors for hostile payloads; a buffer that does not fit is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fedcomp.codecs.sbc as sbc_module
import fedcomp.codecs.threelc as threelc_module
from fedcomp.codecs import Codec, DenseFP32, Lattice, TensorSpec, get_codec
from fedcomp.errors import PayloadError
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.wire.payloads import SBCPayload, ThreeLCPayload

CONFIGS = [
    {"id": "sbc", "p": 0.01, "mode": "fast"},
    {"id": "sbc", "p": 0.2, "mode": "exact"},
    {"id": "3lc", "s": 1.0},
    {"id": "3lc", "s": 1.9, "zero_run": False},
    {"id": "dense-fp16"},
    {"id": "dense-fp32"},
    {"id": "identity"},
    {"id": "topk", "p": 0.05},
    {"id": "stc", "p": 0.05},
]
SHAPES = [(1,), (7,), (64, 33), (3, 5, 2001)]


@pytest.fixture(params=["kernels", "numpy"])
def path(request, monkeypatch) -> str:
    if request.param == "numpy":
        monkeypatch.setattr(sbc_module, "_KERNEL", None)
        monkeypatch.setattr(threelc_module, "_KERNEL", None)
    return request.param


def _codec(config: dict) -> Codec:
    return get_codec(config)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_into_equals_decode(config, shape, path) -> None:
    codec = _codec(config)
    gen = torch.Generator().manual_seed(len(shape) * 31 + shape[-1])
    x = torch.randn(shape, generator=gen)
    x.view(-1)[::3] = 0.0  # zero groups for 3LC, ties for the selections
    enc = codec.encode(x, "w")
    spec = TensorSpec("w", shape)
    want = codec.decode(enc, spec)
    out = torch.full(shape, float("nan"))  # whatever the buffer held
    got = codec.decode_into(enc, spec, out)
    assert got is out
    assert torch.equal(got.view(-1).view(torch.int32), want.view(-1).view(torch.int32))  # bits, signed zeros too


def test_lattice_decode_into_equals_decode(path) -> None:
    codec = Lattice(8.0, -6)
    x = torch.randn(40, 50, generator=torch.Generator().manual_seed(5))
    enc, spec = codec.encode(x, "w"), TensorSpec("w", (40, 50))
    assert torch.equal(codec.decode_into(enc, spec, torch.full((40, 50), 7.0)), codec.decode(enc, spec))


@pytest.mark.parametrize(
    "config,broken",
    [
        ({"id": "sbc", "p": 0.05}, lambda p: dataclasses.replace(p, bits=p.bits[:-1])),
        ({"id": "sbc", "p": 0.05}, lambda p: dataclasses.replace(p, mean=float("nan"))),
        ({"id": "sbc", "p": 0.05}, lambda p: dataclasses.replace(p, nnz=4000)),
        ({"id": "3lc", "s": 1.0}, lambda p: dataclasses.replace(p, data=p.data[:-1])),
        ({"id": "3lc", "s": 1.0}, lambda p: dataclasses.replace(p, data=bytes([250]) + p.data[1:])),
        ({"id": "3lc", "s": 1.0}, lambda p: dataclasses.replace(p, scale=float("inf"))),
        ({"id": "3lc", "s": 1.0, "zero_run": False}, lambda p: dataclasses.replace(p, data=p.data + b"\x79")),
        ({"id": "3lc", "s": 1.0}, lambda p: dataclasses.replace(p, numel=p.numel - 1)),
    ],
)
def test_hostile_payloads_raise_what_decode_raises(config, broken, path) -> None:
    codec = _codec(config)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(9))
    enc = codec.encode(x, "w")
    assert isinstance(enc.payload, SBCPayload | ThreeLCPayload)
    bad = dataclasses.replace(enc, payload=broken(enc.payload))
    spec = TensorSpec("w", (3000,))
    with pytest.raises(PayloadError) as want:
        codec.decode(bad, spec)
    with pytest.raises(PayloadError) as got:
        codec.decode_into(bad, spec, torch.zeros(3000))
    assert str(got.value) == str(want.value)


def test_a_buffer_that_does_not_fit_is_refused() -> None:
    codec = DenseFP32()
    enc, spec = codec.encode(torch.ones(4, 5), "w"), TensorSpec("w", (4, 5))
    for out in (torch.zeros(5, 4), torch.zeros(4, 5, dtype=torch.float64), torch.zeros(5, 4).t()):
        with pytest.raises(ValueError, match="decode_into 'w'"):
            codec.decode_into(enc, spec, out)


def test_decode_update_into_buffers(path) -> None:
    gen = torch.Generator().manual_seed(2)
    tensors = {
        "a": torch.randn(300, 20, generator=gen),
        "b": torch.randn(10, generator=gen),
        "c": torch.randn(2003, generator=gen),
    }
    codec = get_codec({"id": "sbc", "p": 0.05})
    update = UpdateEncoder(codec, error_feedback=False).encode(tensors)
    specs = specs_of(tensors)
    want = decode_update(update, specs, [codec, DenseFP32()])
    buffers = {"a": torch.full((300, 20), 3.0), "c": torch.full((2003,), -1.0)}  # "b" decoded fresh
    got = decode_update(update, specs, [codec, DenseFP32()], out=buffers)
    assert got["a"] is buffers["a"] and got["c"] is buffers["c"]
    for name in want:
        assert torch.equal(got[name], want[name]), name
