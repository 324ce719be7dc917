"""The codec contract, after numcodecs: stateless, a ``codec_id``, encode/decode, config round trip.

A codec turns one tensor into an :class:`EncodedTensor` and back. It holds settings only, never
state: error feedback (residuals) lives in :class:`fedcomp.methods.feedback.ErrorFeedback`, which wraps any
codec. The same code runs on CPU and CUDA: encoding computes on the tensor's device, decoding on
the device it is asked for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedcomp.errors import ConfigError, PayloadError
from fedcomp.wire.payloads import MAX_RANK, WIRE_DTYPES, EncodedTensor, Payload, filled


@dataclass(frozen=True)
class TensorSpec:
    """What the receiver expects a tensor to be. Decoders never allocate beyond ``numel``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), tensor.dtype)


class Codec(ABC):
    """Base class of every fedcomp codec.

    Subclasses set ``codec_id`` and ``version`` and implement :meth:`_encode` and :meth:`_decode`
    on flat float32 tensors; this class handles shapes, dtypes and the checks every decoder needs.
    Two codecs are equal when their configs are equal.
    """

    codec_id: ClassVar[str]
    version: ClassVar[int] = 1
    #: Whether :class:`~fedcomp.methods.update.UpdateEncoder` and
    #: :func:`~fedcomp.methods.update.decode_update` encode and decode several CPU tensors of this
    #: codec at once on threads (:func:`fedcomp.codecs.sbc.run_jobs`): the codec keeps no state
    #: that two threads would share, and releases the GIL for its heavy work (else no gain).
    tensor_parallel: ClassVar[bool] = False

    # --- the contract -------------------------------------------------------------------------

    def encode(self, tensor: torch.Tensor, name: str = "") -> EncodedTensor:
        """Compress ``tensor`` (any float dtype, any device). The dense codecs' payload reads
        ``tensor`` only when it is serialised (no copy): do not change it in place before."""
        return self.encode_with_reconstruction(tensor, name)[0]

    def encode_with_reconstruction(self, tensor: torch.Tensor, name: str = "") -> tuple[EncodedTensor, torch.Tensor]:
        """Compress ``tensor`` and also return what the receiver will decode (same shape and
        device; float32, or the tensor's dtype for the identity codec). Error feedback needs that reconstruction; codecs that can produce it
        while encoding save a decode."""
        check_wire_dtype(tensor, name)
        flat = self._flatten(tensor, name)
        payload, recon = self._encode(flat, name)
        enc = self._envelope(tensor, name, payload)
        if recon is None:
            recon = self._decode(payload, TensorSpec(name, enc.shape), flat.device)
        return enc, recon.reshape(tensor.shape)

    def decode(
        self,
        enc: EncodedTensor,
        spec: TensorSpec,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Rebuild the tensor ``spec`` describes from ``enc``.

        Raises :class:`PayloadError` (naming the tensor) when ``enc`` is not an encoding of a
        tensor of that name, shape and dtype by this codec, or its payload is malformed.
        """
        self.check_envelope(enc, spec)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        flat = self._decode(enc.payload, spec, dev)
        return flat.reshape(spec.shape).to(spec.dtype)

    def decode_into(self, enc: EncodedTensor, spec: TensorSpec, out: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` into ``out``, a contiguous tensor of ``spec``'s shape and dtype (on any
        device), and return it: a receiver that keeps its buffers round after round writes into
        warm memory instead of fresh pages (for a large model, first-touch page faults cost as
        much as the decoding). Same checks and errors as :meth:`decode`; after an error, ``out``
        holds unspecified values. ``ValueError`` when ``out`` does not fit ``spec``."""
        if tuple(out.shape) != tuple(spec.shape) or out.dtype != spec.dtype or not out.is_contiguous():
            raise ValueError(
                f"decode_into {spec.name!r}: out is {out.dtype} {list(out.shape)}"
                f"{'' if out.is_contiguous() else ' (not contiguous)'}, expected {spec.dtype} {list(spec.shape)}"
            )
        self.check_envelope(enc, spec)
        self._decode_into(enc.payload, spec, out.view(-1))
        return out

    def _decode_into(self, payload: Payload, spec: TensorSpec, out: torch.Tensor) -> None:
        """Decode into the flat ``out`` (checked by :meth:`decode_into`). Default: decode, then
        copy; codecs whose CPU decoder can write in place override it."""
        out.copy_(self._decode(payload, spec, out.device))

    def check_envelope(self, enc: EncodedTensor, spec: TensorSpec) -> None:
        """Raise :class:`PayloadError` unless ``enc`` claims to be this codec's encoding of the
        tensor ``spec`` describes (name, codec id and version, shape, dtype)."""
        name = spec.name
        if enc.name != name:
            raise PayloadError(name, f"payload is for tensor {enc.name!r}")
        if enc.codec_id != self.codec_id:
            raise PayloadError(name, f"codec {enc.codec_id!r} where {self.codec_id!r} was expected")
        if enc.codec_version != self.version:
            raise PayloadError(
                name, f"{self.codec_id} version {enc.codec_version} is not supported (have {self.version})"
            )
        if tuple(enc.shape) != tuple(spec.shape):
            raise PayloadError(name, f"shape {list(enc.shape)} where {list(spec.shape)} was expected")
        if spec.dtype not in WIRE_DTYPES:
            raise PayloadError(
                name, f"the receiver's spec says dtype {spec.dtype}, which the wire format does not carry"
            )
        if enc.dtype != WIRE_DTYPES[spec.dtype]:
            raise PayloadError(name, f"dtype {enc.dtype} where {WIRE_DTYPES[spec.dtype]} was expected")

    def get_config(self) -> dict[str, Any]:
        """JSON-safe settings, including ``id``; ``from_config`` of it gives an equal codec."""
        return {"id": self.codec_id, **self._params()}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Codec:
        params = dict(config)
        cid = params.pop("id", cls.codec_id)
        if cid != cls.codec_id:
            raise ConfigError(f"id: {cid!r} is not {cls.codec_id!r}")
        try:
            return cls(**params)
        except TypeError as exc:  # unknown or missing keyword
            raise ConfigError(f"{cls.codec_id}: {exc}") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and type(other) is type(self) and other.get_config() == self.get_config()

    def __hash__(self) -> int:
        return hash(repr(sorted(self.get_config().items())))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({params})"

    def _envelope(self, tensor: torch.Tensor, name: str, payload: Payload) -> EncodedTensor:
        """``payload`` with what the receiver checks it against: ``tensor``'s name, shape and wire
        dtype, and this codec's id and version."""
        return EncodedTensor(
            name=name,
            shape=tuple(int(d) for d in tensor.shape),
            dtype=WIRE_DTYPES[tensor.dtype],
            codec_id=self.codec_id,
            codec_version=self.version,
            payload=payload,
        )

    def _float32_envelopes(
        self, names: Sequence[str], shapes: Sequence[tuple[int, ...]], payloads: Iterable[Payload]
    ) -> list[EncodedTensor]:
        """:meth:`_envelope` of float32 tensors whose names and shapes (tuples of ints) a layout
        already holds: what the whole-update engines send, without reading each tensor's shape and
        dtype again, and made by :func:`~fedcomp.wire.payloads.filled` (a microsecond a tensor of
        a host share that a GPU does not overlap)."""
        cid, version = self.codec_id, self.version
        return [
            filled(
                EncodedTensor,
                {
                    "name": name,
                    "shape": shape,
                    "dtype": "float32",
                    "codec_id": cid,
                    "codec_version": version,
                    "payload": p,
                },
            )
            for name, shape, p in zip(names, shapes, payloads, strict=True)
        ]

    # --- what subclasses implement ------------------------------------------------------------

    def _flatten(self, tensor: torch.Tensor, name: str = "") -> torch.Tensor:
        """The 1-D tensor ``_encode`` works on: float32 and contiguous (no copy when it already is;
        ``reshape`` alone can leave a strided view, of a tensor sliced with a step, say, which the
        CPU kernels cannot read)."""
        flat = tensor.detach().reshape(-1).to(torch.float32).contiguous()
        # (float64 only, a pass of its own) a finite value past float32's range became an infinity
        # here, and the codec's "not finite" would blame the input
        overflowed = tensor.dtype == torch.float64 and flat.numel() and bool(torch.isinf(flat).any())
        if overflowed and bool(torch.isfinite(tensor).all()):
            raise ValueError(
                f"tensor {name!r}: values beyond float32's range (max |T| = "
                f"{float(tensor.detach().abs().max()):.4g}), which every codec computes in"
            )
        return flat

    def _params(self) -> dict[str, Any]:
        """The codec's settings (without ``id``)."""
        return {}

    @abstractmethod
    def _encode(self, flat: torch.Tensor, name: str) -> tuple[Payload, torch.Tensor | None]:
        """Encode a flat float32 tensor; optionally return its float32 reconstruction."""

    @abstractmethod
    def _decode(self, payload: Payload, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        """Decode to a flat float32 tensor of ``spec.numel`` elements on ``device``.

        Must validate everything in ``payload`` against ``spec`` before allocating, and raise
        :class:`PayloadError` naming ``spec.name`` on any inconsistency.
        """


def check_wire_dtype(tensor: torch.Tensor, name: str) -> None:
    """What every encoder checks first: raise TypeError unless ``tensor`` is a torch tensor whose
    dtype has a wire name, ValueError when its rank is more than the wire format carries (its
    receiver would refuse the message)."""
    if not isinstance(tensor, torch.Tensor):
        kind = type(tensor)
        raise TypeError(
            f"tensor {name!r}: a torch.Tensor is needed, got {kind.__module__}.{kind.__qualname__}"
            + (" (torch.from_numpy makes one of a NumPy array)" if kind.__module__ == "numpy" else "")
        )
    if tensor.dtype not in WIRE_DTYPES:
        raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} is not supported")
    if tensor.dim() > MAX_RANK:
        raise ValueError(
            f"tensor {name!r}: rank {tensor.dim()} exceeds {MAX_RANK}, the most the wire format carries (reshape it)"
        )


def check_codec(key: str, value: object) -> None:
    """Raise TypeError naming ``key`` unless ``value`` is a codec (a codec id or config where an
    instance is needed, say)."""
    if not isinstance(value, Codec):
        raise TypeError(f"{key}: a Codec is needed (e.g. SBC(p=0.01), get_codec('sbc')), got {value!r}")


def expect_payload(payload: Payload, kind: type, name: str) -> None:
    """Raise :class:`PayloadError` unless ``payload`` is of the codec's payload type."""
    if not isinstance(payload, kind):
        raise PayloadError(name, f"payload is {type(payload).__name__}, expected {kind.__name__}")
