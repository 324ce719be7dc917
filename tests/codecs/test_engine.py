"""The whole-update path (UpdateEncoder.encode -> wire bytes -> decode_update) against per-tensor
plain-Python references: the bytes of a whole update must be exactly the bytes the reference
implementations give tensor by tensor, over shapes that stress the edges (empty, one value,
just below and at ``min_numel``, ties, all zeros, negative only, fast mode's sampled path), and
decoding must not allocate much beyond the model it rebuilds."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from fedcomp.codecs import SBC, Codec, DenseFP16, DenseFP32, TensorSpec, ThreeLC
from fedcomp.codecs.sbc import _sample_positions
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.wire import serde
from fedcomp.wire.payloads import (
    DensePayload,
    EncodedTensor,
    EncodedUpdate,
    Payload,
    SBCPayload,
    ThreeLCPayload,
)
from tests.codecs import kit
from tests.codecs import reference_sbc as ref_sbc
from tests.codecs import reference_threelc as ref_3lc

MIN_NUMEL = 1000
SAMPLE = 1500  # fast SBC samples tensors above this many values


def varied_update(seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors at every edge the engine has to get right, in a fixed order."""
    g = np.random.default_rng(seed)
    t = {
        "empty": np.zeros((0, 3)),
        "one": np.array([0.25]),
        "below_min": g.standard_t(3, 999) * 1e-2,
        "at_min": g.standard_t(3, (10, 100)) * 1e-2,
        "ties": g.integers(-2, 3, 2000) * 0.5,
        "all_zero": np.zeros(3000),
        "negative_only": -np.abs(g.standard_t(3, 2500)) - 1e-3,
        "positive_sparse": np.where(g.random(4000) < 0.01, np.abs(g.standard_normal(4000)), 0.0),
        "conv": g.standard_t(3, (8, 4, 5, 5)) * 1e-3,  # 800 values: dense
        "big_conv": g.standard_t(3, (16, 8, 3, 3, 3)) * 1e-3,  # 3456 values: sampled in fast mode
        "fc": g.standard_normal((60, 100)) * 1e-2,
        "huge_range": g.standard_normal(2048) * 10.0 ** g.integers(-30, 30, 2048),
    }
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in t.items()}


def _dense32(name: str, x: torch.Tensor) -> EncodedTensor:
    data = x.numpy().astype("<f4").tobytes()
    return EncodedTensor(name, tuple(x.shape), "float32", "dense-fp32", 1, DensePayload("float32", data))


def reference_update(codec: Codec, tensors: dict[str, torch.Tensor]) -> EncodedUpdate:
    """Each tensor through the plain-Python reference of ``codec`` (dense fp32 below MIN_NUMEL)."""
    out = []
    for name, x in tensors.items():
        values = x.reshape(-1).tolist()
        n = len(values)
        if n < MIN_NUMEL:
            out.append(_dense32(name, x))
            continue
        payload: Payload
        if isinstance(codec, SBC):
            if codec.mode == "fast" and n > codec.sample_size:
                sample = _sample_positions(n, codec.sample_size, "cpu").tolist()
                mean, b, nnz, bits = ref_sbc.sbc_fast(values, codec.p, sample)
            else:
                mean, b, nnz, bits = ref_sbc.sbc_exact(values, codec.p)
            payload = SBCPayload(mean=mean, golomb_b=b, nnz=nnz, bits=bits)
        elif isinstance(codec, ThreeLC):
            scale, data = ref_3lc.encode(values, codec.s, codec.zero_run)
            payload = ThreeLCPayload(scale=scale, numel=n, zero_run=codec.zero_run, data=data)
        else:  # dense fp16: NumPy's IEEE round-to-nearest-even cast (inf past its range), not torch's
            assert isinstance(codec, DenseFP16)
            with np.errstate(over="ignore"):
                payload = DensePayload("float16", x.numpy().astype("<f2").tobytes())
        out.append(EncodedTensor(name, tuple(x.shape), "float32", codec.codec_id, 1, payload))
    return EncodedUpdate(base_model_version=0, tensors=tuple(out))


CODECS = [
    SBC(0.01, "fast", sample_size=SAMPLE),
    SBC(0.05, "fast", sample_size=SAMPLE),
    SBC(0.01, "exact"),
    ThreeLC(1.0),
    ThreeLC(1.9),
    ThreeLC(1.0, zero_run=False),
    DenseFP16(),
]


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("seed", [0, 1])
def test_whole_update_bytes_equal_the_per_tensor_references(codec: Codec, seed: int) -> None:
    tensors = varied_update(seed)
    enc = UpdateEncoder(codec, min_numel=MIN_NUMEL, error_feedback=False)
    got = serde.update_to_bytes(enc.encode(tensors))
    assert got == serde.update_to_bytes(reference_update(codec, tensors))
    # the per-tensor public API gives the same tensors
    per_tensor = [(enc.small_codec if t.numel() < MIN_NUMEL else codec).encode(t, n) for n, t in tensors.items()]
    assert serde.update_to_bytes(EncodedUpdate(0, tuple(per_tensor))) == got


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_whole_update_decodes_to_the_reference_values(codec: Codec) -> None:
    tensors = varied_update(2)
    enc = UpdateEncoder(codec, min_numel=MIN_NUMEL, error_feedback=False)
    data = serde.update_to_bytes(enc.encode(tensors))
    specs = specs_of(tensors)
    out = decode_update(serde.update_from_bytes(data, specs), specs, [codec, DenseFP32()])
    assert list(out) == list(tensors)
    for spec, e in zip(specs, reference_update(codec, tensors).tensors, strict=True):
        p = e.payload
        if isinstance(p, SBCPayload):
            want = np.zeros(spec.numel, dtype=np.float32)
            want[ref_sbc.decode_positions(p.bits, p.nnz, p.golomb_b)] = p.mean
        elif isinstance(p, ThreeLCPayload):
            want = np.array(ref_3lc.decode(p.scale, p.data, spec.numel, p.zero_run), dtype=np.float32)
        else:
            assert isinstance(p, DensePayload)
            want = np.frombuffer(p.data, dtype="<f2" if p.encoding == "float16" else "<f4").astype(np.float32)
        got = out[spec.name]
        assert got.shape == spec.shape and got.dtype == torch.float32
        assert got.numpy().reshape(-1).tobytes() == want.tobytes(), spec.name  # bits, signed zeros included


# LeNet5-Caffe's shapes: a small model whose decode must stay within about its own size.
LENET = {"c1.w": (20, 1, 5, 5), "c1.b": (20,), "c2.w": (50, 20, 5, 5), "c2.b": (50,)}
LENET |= {"f1.w": (500, 800), "f1.b": (500,), "f2.w": (10, 500), "f2.b": (10,)}


@pytest.mark.parametrize(
    ("codec", "factor"),
    [
        (SBC(0.01), 1.0),
        (SBC(0.1), 1.0),
        (SBC(0.4), 2.0),  # 40 % kept: the int64 positions alone are 3.2 bytes per value
        (ThreeLC(1.0), 1.0),
        (ThreeLC(1.0, zero_run=False), 1.0),
        (DenseFP16(), 1.0),
    ],
    ids=repr,
)
def test_decoding_a_small_model_allocates_about_its_own_size(codec: Codec, factor: float) -> None:
    """Beyond the output tensors, decoding allocates at most about the model's own size: NumPy
    temporaries (traced by tracemalloc: the peak less what the outputs keep) at most ``factor``
    times the model's bytes, and torch tensors no bigger than the model's largest tensor."""
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=g) * 1e-2 for k, s in LENET.items()}
    model_bytes = 4 * sum(t.numel() for t in tensors.values())
    specs = [TensorSpec(k, tuple(s)) for k, s in LENET.items()]
    data = serde.update_to_bytes(UpdateEncoder(codec, error_feedback=False).encode(tensors))
    update = serde.update_from_bytes(data, specs)
    decode_update(update, specs, [codec, DenseFP32()])  # warm: lazy imports and caches are not the decoder's
    with kit.LargestTensor() as made:
        decode_update(update, specs, [codec, DenseFP32()])
    tracemalloc.start()  # separately: the dispatch mode's own bookkeeping would be traced too
    try:
        out = decode_update(update, specs, [codec, DenseFP32()])
        kept, peak = tracemalloc.get_traced_memory()  # kept: outputs NumPy allocated (SBC's zeros)
    finally:
        tracemalloc.stop()
    assert sum(t.numel() for t in out.values()) == model_bytes // 4
    assert made.largest <= max(s.numel for s in specs)
    extra = peak - kept
    assert extra <= factor * model_bytes, f"{extra} bytes of temporaries decoding a {model_bytes}-byte model"
