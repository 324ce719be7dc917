"""Dense baselines: fp32, fp16, and a lossless identity codec for tests."""

from __future__ import annotations

import numpy as np
import torch

from fedcomp.codecs.base import Codec, TensorSpec, expect_payload
from fedcomp.errors import PayloadError
from fedcomp.wire.payloads import (
    DTYPE_SIZES,
    TORCH_DTYPES,
    WIRE_DTYPES,
    DensePayload,
    Payload,
)


def tensor_to_le_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a tensor (every platform torch runs on is little-endian)."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


class _DenseCodec(Codec):
    """Sends every value. ``_wire`` is the element type on the wire; None keeps the tensor's own."""

    _wire: str | None = None

    def _flatten(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.detach().reshape(-1)
        return flat if self._wire is None else flat.to(torch.float32)

    def _encode(self, flat: torch.Tensor, name: str) -> tuple[Payload, torch.Tensor | None]:
        wire = flat if self._wire is None else flat.to(TORCH_DTYPES[self._wire])
        return DensePayload(WIRE_DTYPES[wire.dtype], tensor_to_le_bytes(wire)), wire.to(flat.dtype)

    def _decode(self, payload: Payload, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        expect_payload(payload, DensePayload, spec.name)
        assert isinstance(payload, DensePayload)
        expected = self._wire or WIRE_DTYPES.get(spec.dtype)
        if payload.encoding != expected:
            raise PayloadError(spec.name, f"dense encoding {payload.encoding!r} where {expected!r} was expected")
        want = spec.numel * DTYPE_SIZES[payload.encoding]
        if len(payload.data) != want:
            raise PayloadError(spec.name, f"dense data is {len(payload.data)} bytes, expected {want}")
        if want == 0:
            return torch.zeros(0, dtype=TORCH_DTYPES[payload.encoding], device=device)
        # One copy, straight from the received bytes into the output (a bytearray() of the data
        # first would hold a second whole-tensor copy at the decoder's peak: FORMAT.md bounds a
        # decode's memory by the model's size).
        raw = torch.from_numpy(np.frombuffer(payload.data, dtype=np.uint8).copy())
        return raw.view(TORCH_DTYPES[payload.encoding]).to(device)


class DenseFP32(_DenseCodec):
    """Every value as float32: the uncompressed baseline (dense FedAvg)."""

    codec_id = "dense-fp32"
    _wire = "float32"


class DenseFP16(_DenseCodec):
    """Every value rounded to float16: half the bytes, nothing else."""

    codec_id = "dense-fp16"
    _wire = "float16"


class Identity(_DenseCodec):
    """Lossless: the tensor's own dtype and bits. For tests (the wrapper must equal plain FedAvg)."""

    codec_id = "identity"
    _wire = None
