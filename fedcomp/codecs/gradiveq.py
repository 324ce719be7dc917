"""The GradiVeQ codec: a tensor's slice coefficients under a broadcast PCA compressor.

The maths (slicing, PCA fit, linearity) lives in :mod:`fedcomp.methods.gradiveq`; this module puts it
behind the codec contract. One codec instance holds a whole :class:`~fedcomp.methods.gradiveq.Compressor`
and looks the basis up by tensor name, so a single codec serves a whole update, like the other
codecs.

**Config.** The contract wants codecs built from JSON-safe configs, but a compressor is a large
runtime parameter (``d x k`` floats per tensor) that the server broadcasts on every refresh; it
does not belong in a config. So ``get_config()`` is ``{"id": "gradiveq", "compressor_version":
v, "compressor_digest": h}``: it *identifies* the compressor (two codecs are equal when they use
the same compressor, by content) without carrying it. ``from_config(config, compressor=c)``
rebuilds the codec from ``c`` and checks that version and digest match; without a compressor
(as in ``get_codec("gradiveq")``) it raises :class:`ConfigError`.

A tensor the compressor does not cover (``dim == 0`` or absent) cannot be encoded by this codec:
:meth:`GradiVeQ.encode` raises :class:`ValueError` and the caller sends it dense (check
:meth:`Compressor.compresses` first).

The wire bytes of the coefficients depend on the float32 matrix product's summation order (the
BLAS in use, the device), unlike SBC's; the golden fixtures use values for which every sum is
exact. Within one process, :meth:`encode_with_reconstruction` returns exactly what the decoder
rebuilds from the bytes (same kernels on the same coefficients).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedcomp.codecs import pca as gvq
from fedcomp.codecs.base import Codec, TensorSpec, expect_payload
from fedcomp.codecs.pca import Compressor
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.wire.payloads import EncodedTensor, GradiVeQPayload, Payload

__all__ = ["GradiVeQ", "coefficients_of"]


class GradiVeQ(Codec):
    """GradiVeQ compression of one tensor with the basis ``compressor`` holds for its name.

    ``_encode`` returns the payload and the reconstruction ``U c + mu`` (what error feedback
    needs). The decoder checks the payload against the compressor before allocating: same
    compressor version, the tensor's ``slice_size`` and ``dim``, exactly
    ``ceil(numel / d) * k * 4`` coefficient bytes, finite values.
    """

    codec_id = "gradiveq"
    version = 1

    def __init__(self, compressor: Compressor) -> None:
        if not isinstance(compressor, gvq.Compressor):
            raise ConfigError(
                f"compressor: gradiveq needs the fedcomp.methods.gradiveq.Compressor the server broadcast, "
                f"got {type(compressor).__name__}"
            )
        self.compressor = compressor

    def _params(self) -> dict[str, Any]:
        return {"compressor_version": self.compressor.version, "compressor_digest": self.compressor.digest}

    @classmethod
    def from_config(cls, config: dict[str, Any], compressor: Compressor | None = None) -> GradiVeQ:
        """Rebuild from ``get_config()`` output *and* the compressor it names (see module doc)."""
        params = dict(config)
        cid = params.pop("id", cls.codec_id)
        if cid != cls.codec_id:
            raise ConfigError(f"id: {cid!r} is not {cls.codec_id!r}")
        if compressor is None:
            raise ConfigError(
                "compressor: gradiveq cannot be built from a config alone; its basis is a runtime "
                "parameter: use GradiVeQ(compressor) or GradiVeQ.from_config(config, compressor=...)"
            )
        unknown = set(params) - {"compressor_version", "compressor_digest"}
        if unknown:
            raise ConfigError(f"gradiveq: unknown config keys {sorted(unknown)}")
        codec = cls(compressor)
        for key, have in codec._params().items():
            if key in params and params[key] != have:
                raise ConfigError(f"{key}: config says {params[key]!r}, the compressor given has {have!r}")
        return codec

    # --- encoding -----------------------------------------------------------------------------

    def _encode(self, flat: torch.Tensor, name: str) -> tuple[Payload, torch.Tensor | None]:
        if not self.compressor.compresses(name):
            raise ValueError(
                f"tensor {name!r}: not compressed by GradiVeQ compressor version "
                f"{self.compressor.version}; send it dense"
            )
        b = self.compressor.basis(name)
        coeffs = gvq.compress(self.compressor, name, flat)
        # a NaN or infinity anywhere in x reaches every coefficient of its slice (inf * 0 is NaN):
        # checking the k/d times smaller coefficients catches it
        if not bool(torch.isfinite(coeffs).all()):
            raise ValueError(f"tensor {name!r}: GradiVeQ cannot encode NaN or infinite values")
        data = coeffs.cpu().numpy().astype("<f4", copy=False).tobytes()
        payload = GradiVeQPayload(
            compressor_version=self.compressor.version, slice_size=b.slice_size, dim=b.dim, coefficients=data
        )
        return payload, gvq.decompress(self.compressor, name, coeffs, flat.numel())

    # --- decoding -----------------------------------------------------------------------------

    def _decode(self, payload: Payload, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        coeffs = self._coefficients(payload, spec, device)
        return gvq.decompress(self.compressor, spec.name, coeffs, spec.numel)

    def _coefficients(self, payload: Payload, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        """Validate ``payload`` against the compressor and ``spec``; the (num_slices, k) float32
        coefficients on ``device``."""
        name = spec.name
        expect_payload(payload, GradiVeQPayload, name)
        assert isinstance(payload, GradiVeQPayload)
        comp = self.compressor
        v, d, k, data = payload.compressor_version, payload.slice_size, payload.dim, payload.coefficients
        if not (
            all(isinstance(i, int) and not isinstance(i, bool) for i in (v, d, k))
            and isinstance(data, (bytes, bytearray, memoryview))
        ):
            raise PayloadError(name, "GradiVeQ payload fields have the wrong types")
        if v != comp.version:
            raise PayloadError(name, f"coefficients are for compressor version {v}, this is version {comp.version}")
        if not comp.compresses(name):
            raise PayloadError(name, f"compressor version {comp.version} does not compress this tensor")
        b = comp.basis(name)
        if (d, k) != (b.slice_size, b.dim):
            raise PayloadError(name, f"slice_size {d} / dim {k} where the compressor has {b.slice_size} / {b.dim}")
        want = gvq.num_slices(spec.numel, d) * k * 4
        if len(data) != want:
            raise PayloadError(name, f"coefficients are {len(data)} bytes, expected ceil(numel/d)*k*4 = {want}")
        arr = np.frombuffer(data, dtype="<f4")
        if not np.isfinite(arr).all():
            raise PayloadError(name, "coefficients hold NaN or infinite values")
        return torch.from_numpy(arr.astype(np.float32)).reshape(-1, k).to(device)


def coefficients_of(
    enc: EncodedTensor,
    spec: TensorSpec,
    compressor: Compressor,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The (num_slices, k) coefficients of an untrusted GradiVeQ tensor, validated exactly as
    :meth:`GradiVeQ.decode` would, but not decompressed: the server sums these over clients
    (:func:`fedcomp.methods.gradiveq.aggregate`) and decompresses once.

    Raises :class:`PayloadError` naming the tensor on any mismatch (name, codec, shape, dtype,
    compressor version, slice size, dim, byte length, non-finite values).
    """
    codec = GradiVeQ(compressor)
    codec.check_envelope(enc, spec)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return codec._coefficients(enc.payload, spec, dev)
