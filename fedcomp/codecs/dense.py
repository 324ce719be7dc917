"""Dense baselines: fp32, fp16, and a lossless identity codec for tests.

Speed: these codecs should cost one cast (which is also the copy). :meth:`_DenseCodec.encode`
returns a :class:`~fedcomp.wire.fast_writer.DeferredDensePayload`: the tensor is cast when the
update is serialized, straight into its slot of the wire bytes (``fedcomp.wire.fast_writer``), so
encoding a whole update writes each value once; it builds no reconstruction (only error feedback
needs it, through :meth:`_DenseCodec._encode`, which casts eagerly: its input is the feedback's
accumulator, which may change before the update is written). Decoding on CPU casts straight from
the received bytes into the output tensor (one pass, no intermediate copy of the wire data).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from fedcomp.codecs.base import Codec, TensorSpec, check_wire_dtype, expect_payload
from fedcomp.errors import PayloadError
from fedcomp.wire.fast_writer import DeferredDensePayload
from fedcomp.wire.payloads import (
    DTYPE_SIZES,
    TORCH_DTYPES,
    WIRE_DTYPES,
    DensePayload,
    EncodedTensor,
    Payload,
)


def tensor_to_le_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a tensor (every platform torch runs on is little-endian)."""
    if not t.numel():  # (an empty array from NumPy has stride 0, which ``view`` refuses)
        return b""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def _readonly_view(data: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over ``data`` without copying it; only ever read (the source of a copy_)."""
    with warnings.catch_warnings():  # torch warns that the buffer is not writable: it is never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype)


class _DenseCodec(Codec):
    """Sends every value. ``_wire`` is the element type on the wire; None keeps the tensor's own."""

    _wire: str | None = None

    def _flatten(self, tensor: torch.Tensor, name: str = "") -> torch.Tensor:
        flat = tensor.detach().reshape(-1)
        return flat if self._wire is None else flat.to(torch.float32)

    def encode(self, tensor: torch.Tensor, name: str = "") -> EncodedTensor:
        """:meth:`Codec.encode` without the reconstruction, and without casting yet: the payload
        is deferred (:class:`DeferredDensePayload`), cast once when the update is written, straight
        into the wire bytes. Inputs other than float32 go through float32 first (as
        :meth:`_flatten` defines), so the bytes do not depend on the path. ``tensor`` is read when
        the update is serialized: do not modify it in between."""
        check_wire_dtype(tensor, name)
        encoding = self._wire or WIRE_DTYPES[tensor.dtype]
        return self._envelope(tensor, name, DeferredDensePayload(encoding, tensor))

    def _encode(self, flat: torch.Tensor, name: str) -> tuple[Payload, torch.Tensor | None]:
        wire = flat if self._wire is None else flat.to(TORCH_DTYPES[self._wire])
        return DensePayload(WIRE_DTYPES[wire.dtype], tensor_to_le_bytes(wire)), wire.to(flat.dtype)

    def decode(self, enc: EncodedTensor, spec: TensorSpec, device: torch.device | str | None = None) -> torch.Tensor:
        """:meth:`Codec.decode` in one pass on CPU: the wire values are cast straight from the
        received bytes into a tensor of ``spec``'s dtype (no intermediate copy)."""
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type != "cpu":
            return super().decode(enc, spec, dev)
        self.check_envelope(enc, spec)
        payload = self.checked_payload(enc.payload, spec)
        out = torch.empty(spec.shape, dtype=spec.dtype)
        if out.numel():
            out.view(-1).copy_(_readonly_view(payload.data, TORCH_DTYPES[payload.encoding]))
        return out

    def _decode_into(self, payload: Payload, spec: TensorSpec, out: torch.Tensor) -> None:
        if out.device.type != "cpu":
            return super()._decode_into(payload, spec, out)
        checked = self.checked_payload(payload, spec)
        if out.numel():
            out.copy_(_readonly_view(checked.data, TORCH_DTYPES[checked.encoding]))

    def checked_payload(self, payload: Payload, spec: TensorSpec) -> DensePayload:
        """``payload`` if it is this codec's dense payload for ``spec`` (encoding and length), else
        :class:`PayloadError`: the decoder's checks, for a caller that reads the values itself."""
        expect_payload(payload, DensePayload, spec.name)
        assert isinstance(payload, DensePayload)
        expected = self._wire or WIRE_DTYPES.get(spec.dtype)
        if payload.encoding != expected:
            raise PayloadError(spec.name, f"dense encoding {payload.encoding!r} where {expected!r} was expected")
        want = spec.numel * DTYPE_SIZES[payload.encoding]
        if len(payload.data) != want:
            raise PayloadError(spec.name, f"dense data is {len(payload.data)} bytes, expected {want}")
        return payload

    def _decode(self, payload: Payload, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        payload = self.checked_payload(payload, spec)
        want = len(payload.data)
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
