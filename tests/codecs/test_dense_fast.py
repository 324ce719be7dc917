"""The dense codecs' one-pass encode gives the bytes the eager path gave.

``DenseFP16/DenseFP32/Identity.encode`` defer the cast (``DeferredDensePayload``) so the wire
writer casts each tensor straight into the update's bytes. Here a whole update, through the
library's ``UpdateEncoder`` with and without error feedback, must equal the update built from the
eager payloads (``_encode``: cast, then ``tobytes``) and serialized by protobuf itself.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedcomp.codecs import TensorSpec, get_codec
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.wire import serde
from fedcomp.wire.fast_writer import DeferredDensePayload
from fedcomp.wire.payloads import EncodedUpdate


def _update(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    shapes = {"conv": (16, 3, 3, 3), "bias": (16,), "fc": (40, 70), "scalar": (), "empty": (0, 4), "big": (3001,)}
    return {name: (torch.randn(shape, generator=gen) * 3).to(dtype) for name, shape in shapes.items()}


def _eager(update: EncodedUpdate, tensors: dict[str, torch.Tensor]) -> EncodedUpdate:
    """The same update with each deferred payload cast the old way (cast, then ``tobytes``)."""
    out = []
    for t, x in zip(update.tensors, tensors.values(), strict=True):
        if isinstance(t.payload, DeferredDensePayload):
            codec = get_codec(t.codec_id)
            payload, _ = codec._encode(codec._flatten(x), t.name)
            t = dataclasses.replace(t, payload=payload)
        out.append(t)
    return dataclasses.replace(update, tensors=tuple(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("codec_id", ["dense-fp16", "dense-fp32", "identity"])
@pytest.mark.parametrize("feedback", [False, True])
def test_update_bytes_equal_the_eager_protobuf_bytes(codec_id, dtype, feedback):
    tensors = _update(dtype)
    codec = get_codec(codec_id)
    enc = UpdateEncoder(codec, min_numel=100, error_feedback=feedback).encode(tensors, base_model_version=4)
    for t, x in zip(enc.tensors, tensors.values(), strict=True):
        # Small tensors go dense-fp32 (deferred); the feedback path casts eagerly (its input is its
        # accumulator, which changes after the encode).
        small = x.numel() < 100
        assert isinstance(t.payload, DeferredDensePayload) == (small or not feedback), t.name
    data = serde.update_to_bytes(enc)
    assert data == serde.update_to_bytes_protobuf(_eager(enc, tensors))
    if feedback and dtype != torch.float32:
        return  # the feedback accumulates in float32: the large tensors are sent as float32 tensors
    decoded = decode_update(serde.update_from_bytes(data), specs_of(tensors), [codec, get_codec("dense-fp32")])
    for name, x in tensors.items():
        used = "dense-fp32" if x.numel() < 100 else codec_id
        want = x if used == "identity" else x.to(torch.float32)
        if used == "dense-fp16":
            want = want.to(torch.float16).to(torch.float32)
        assert torch.equal(decoded[name], want), name


def test_in_memory_decode_of_a_deferred_payload():
    # Without serializing, a deferred payload decodes like any other (its data cast on demand).
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    codec = get_codec("dense-fp16")
    enc = codec.encode(x, "w")
    out = codec.decode(enc, TensorSpec("w", (3, 4)))
    assert torch.equal(out, x.half().float())
