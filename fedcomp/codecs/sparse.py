"""Exact sparse coding: every entry above a threshold, as Golomb-coded positions plus values.

Made for the downlink delta ``W - R`` under a sparse uplink: the aggregate of SBC/top-k updates
is nonzero only on the union of the clients' positions, so with an exact replica ``W - R`` has
exactly that support and sending it costs the union, not the model (issue 12; 3LC's max-based
scale rounds most of such a spiky delta to zero).

``Sparse(values="float32")`` keeps every nonzero entry and sends its float32 value: the decoded
tensor equals the input bit for bit. ``Sparse(values="float16")`` sends float16 values, and a
relative ``threshold`` (default ``2**-10``) drops entries with ``|x| <= threshold * max|x|``.
Why: float16 rounding leaves a residual of up to ``2**-11 |x|`` on every sent entry, which
``W - R`` keeps and the next round would resend; without a threshold every entry ever sent
would be resent, forever, as rounding noise. With ``threshold = 2**-10`` a residual is below the
next round's threshold whenever the next delta's largest entry is at least half this one's.

The bound (FORMAT.md, "sparse"): with ``m = max|x|`` over the tensor and ``t`` the threshold,
every decoded entry ``y`` of an input ``x`` satisfies ``|x - y| <= max(t * m, 2**-11 |x|, 2**-25)``
for float16 (``2**-25``: float16's subnormal spacing, entries that round to zero are dropped;
values beyond 65504 saturate, as :mod:`~fedcomp.codecs.topk`'s do) and ``|x - y| <= t * m`` for
float32. Entries are sent only if their wire value is nonzero, so a decoder rejects a zero
value: the encoding of a tensor is unique.

The message is a :class:`~fedcomp.wire.payloads.SparsePayload`, the same as top-k's: positions
ascending, Golomb-Rice coded exactly as SBC's (:mod:`fedcomp.codecs.golomb`, parameter
``golomb_b(nnz / numel)``), and the values little-endian. A decoder accepts either value
encoding whatever its own ``values`` (the payload names it; neither needs a setting of the
decoder), so one decoder serves a downlink that switches between float16 and float32 rounds.
Inputs must be finite (:class:`ValueError` otherwise).
"""

from __future__ import annotations

from typing import Any

import torch

from fedcomp.codecs.base import Codec, TensorSpec, expect_payload
from fedcomp.codecs.topk import decode_sparse_payload, sparse_payload
from fedcomp.errors import ConfigError, PayloadError, check_number
from fedcomp.wire.payloads import Payload, SparsePayload

VALUE_ENCODINGS = ("float32", "float16")

#: The float16 codec's default relative threshold: twice float16's unit roundoff (``2**-11``).
FP16_THRESHOLD = 2.0**-10

#: Largest finite float16.
_F16_MAX = 65504.0


class Sparse(Codec):
    """Every entry with ``|x| > threshold * max|x|`` (all nonzero entries when ``threshold`` is 0),
    at Golomb-coded positions, values in ``values`` ("float32" or "float16").

    ``threshold`` in ``[0, 1)``; ``None`` means 0 for float32 (exact) and :data:`FP16_THRESHOLD`
    for float16 (see the module docstring for why and for the bound it gives).
    """

    codec_id = "sparse"
    version = 1

    def __init__(self, values: str = "float32", threshold: float | None = None) -> None:
        if values not in VALUE_ENCODINGS:
            raise ConfigError(f"values: must be one of {list(VALUE_ENCODINGS)}, got {values!r}")
        if threshold is None:
            threshold = FP16_THRESHOLD if values == "float16" else 0.0
        threshold = check_number("threshold", threshold, low=0.0, high=1.0, low_open=False, high_open=True)
        self.values = values
        self.threshold = float(threshold)

    def _params(self) -> dict[str, Any]:
        return {"values": self.values, "threshold": self.threshold}

    # --- encoding -----------------------------------------------------------------------------

    def select(self, flat: torch.Tensor, name: str = "") -> torch.Tensor:
        """Ascending positions (int64) this codec sends of the flat float32 tensor ``flat``."""
        a = flat.abs()
        if flat.numel() and not bool(torch.isfinite(a).all()):
            raise ValueError(f"tensor {name!r}: cannot encode NaN or infinite values")
        limit = self.threshold * float(a.max()) if flat.numel() else 0.0
        keep = a > limit
        if self.values == "float16":
            keep &= flat.to(torch.float16) != 0  # underflows to zero: nothing to send
        return keep.nonzero().view(-1)

    def _encode(self, flat: torch.Tensor, name: str) -> tuple[Payload, torch.Tensor | None]:
        return sparse_payload(flat, self.select(flat, name), self.values)

    # --- decoding -----------------------------------------------------------------------------

    def _decode(self, payload: Payload, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        name = spec.name
        expect_payload(payload, SparsePayload, name)
        assert isinstance(payload, SparsePayload)
        if payload.value_encoding not in VALUE_ENCODINGS:
            raise PayloadError(name, f"value encoding {payload.value_encoding!r} is not one of {list(VALUE_ENCODINGS)}")
        return decode_sparse_payload(payload, spec, device, nonzero=True)


def fp16_error_bound(x: torch.Tensor, threshold: float = FP16_THRESHOLD) -> torch.Tensor:
    """Per entry of ``x`` (float32), the most ``Sparse("float16", threshold)`` may change it by:
    ``max(threshold * max|x|, 2**-11 |x|, 2**-25)`` (the module docstring's bound; for
    ``|x| <= 65504``)."""
    a = x.detach().to(torch.float32).abs()
    m = float(a.max()) if a.numel() else 0.0
    return torch.clamp(a * 2.0**-11, min=max(threshold * m, 2.0**-25))


__all__ = ["FP16_THRESHOLD", "VALUE_ENCODINGS", "Sparse", "fp16_error_bound"]
