"""Top-k sparsification: the largest entries by magnitude, as Golomb-coded positions plus values.

Two ways to say which entries:

* ``TopK(p=...)``: plain per-client top-k of the whole tensor, ``k = max(1, round(p * numel))``.
* ``TopK(ranges=((start, stop, k), ...))``: DEFT's layer-wise selection (Yoon and Oh, ICPP 2023,
  Algorithm 5): the top ``k`` by magnitude inside each range ``[start, stop)`` of the flattened
  tensor, nothing outside. The ranges come from the server's allocation for this round
  (:mod:`fedcomp.methods.deft`); ``ranges=()`` sends nothing.

The message (:class:`~fedcomp.wire.payloads.SparsePayload`) is the positions in ascending
order, Golomb-Rice coded exactly as SBC's (:mod:`fedcomp.codecs.golomb`, parameter
``golomb_b(nnz / numel)``), and the values at those positions as little-endian float32 or
float16. Ties at the selection boundary go to the lowest index, so the bytes depend on the values
only. Selection is a linear-time partition (NumPy on CPU, torch elsewhere) rather than the
``O(n log k)`` heap the paper's cost model assumes; both DEFT and plain top-k use it.

Float16 values saturate at +-65504 (a finite message, not an infinity). Inputs must be finite:
a NaN or infinity among the entries a selection looks at raises :class:`ValueError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from fedcomp.codecs.base import Codec, TensorSpec, check_wire_dtype, expect_payload
from fedcomp.codecs.golomb import decode_positions, encode_positions, golomb_b
from fedcomp.errors import ConfigError, PayloadError, check_number
from fedcomp.wire.payloads import DTYPE_SIZES, TORCH_DTYPES, EncodedTensor, Payload, SparsePayload

VALUE_ENCODINGS = ("float32", "float16")

#: Largest finite float16.
_F16_MAX = 65504.0

Range = tuple[int, int, int]


def sparse_payload(flat: torch.Tensor, idx: torch.Tensor, values: str) -> tuple[SparsePayload, torch.Tensor]:
    """The :class:`SparsePayload` of ``flat`` at the ascending positions ``idx`` (values as
    ``values``, float16 saturated at +-65504), and what a receiver decodes from it (float32)."""
    payload, vals = sparse_payload_values(flat, idx, values)
    recon = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
    return payload, recon.index_copy_(0, idx, vals)


def sparse_payload_values(flat: torch.Tensor, idx: torch.Tensor, values: str) -> tuple[SparsePayload, torch.Tensor]:
    """:func:`sparse_payload`, with the values a receiver decodes at ``idx`` (float32) instead
    of the dense tensor they make."""
    n = flat.numel()
    vals = flat.index_select(0, idx)
    if values == "float16":
        vals = vals.clamp(-_F16_MAX, _F16_MAX).to(torch.float16)
    nnz = idx.numel()
    b = golomb_b(nnz / n) if nnz else 0
    raw = vals.contiguous().cpu().view(torch.uint8).numpy().tobytes()
    payload = SparsePayload(golomb_b=b, nnz=nnz, bits=encode_positions(idx, b), value_encoding=values, values=raw)
    return payload, vals.to(torch.float32)


def decode_sparse_payload(
    payload: SparsePayload,
    spec: TensorSpec,
    device: torch.device,
    *,
    nonzero: bool = False,
    ranges: Sequence[Range] | None = None,
) -> torch.Tensor:
    """The dense float32 tensor of a :class:`SparsePayload` whose value encoding is known valid.
    ``nonzero``: a zero value is an error too; ``ranges``: every position must lie in one."""
    idx, vals = decode_sparse_values(payload, spec, device, nonzero=nonzero, ranges=ranges)
    out = torch.zeros(spec.numel, dtype=torch.float32, device=device)
    if vals.numel():
        out.index_copy_(0, idx, vals)
    return out


def decode_sparse_values(
    payload: SparsePayload,
    spec: TensorSpec,
    device: torch.device,
    *,
    nonzero: bool = False,
    ranges: Sequence[Range] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_sparse_payload` without its dense tensor, after every one of its checks:
    the positions (strictly ascending int64) and their float32 values (what a server's running
    sum adds without a tensor of the model's size per reply)."""
    name, numel = spec.name, spec.numel
    nnz = int(payload.nnz)
    if nnz > numel:
        raise PayloadError(name, f"nnz {nnz} exceeds the tensor's {numel} elements")
    want = nnz * DTYPE_SIZES[payload.value_encoding]
    if len(payload.values) != want:
        raise PayloadError(name, f"values are {len(payload.values)} bytes, expected {want} for nnz {nnz}")
    # The values (nnz <= numel of them, checked above) are checked before anything of the
    # tensor's size, or the positions, is allocated.
    vals = torch.frombuffer(bytearray(payload.values), dtype=TORCH_DTYPES[payload.value_encoding]) if nnz else None
    if vals is not None:
        if not bool(torch.isfinite(vals).all()):
            raise PayloadError(name, "a value is NaN or infinite")
        if nonzero and not bool((vals != 0).all()):
            raise PayloadError(name, "a value is zero (the encoder never sends one)")
    # decode_positions guarantees nnz strictly increasing positions in [0, numel)
    idx = decode_positions(payload.bits, nnz, payload.golomb_b, numel, name, device)
    if ranges is not None:
        check_positions(idx, ranges, name)
    if vals is None:
        return idx, torch.zeros(0, dtype=torch.float32, device=device)
    return idx, vals.to(device=device, dtype=torch.float32)


def topk_positions(x: torch.Tensor, k: int, name: str = "") -> torch.Tensor:
    """Ascending positions (int64, on ``x``'s device) of the ``k`` entries of the 1-D float
    tensor ``x`` with the largest magnitude; ties at the boundary go to the lowest indices.

    Raises :class:`ValueError` when a NaN or infinity would take part in the selection (any
    infinity; a NaN, which orders above every number, whenever one is present).
    """
    n = x.numel()
    k = min(int(k), n)
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64, device=x.device)
    if x.device.type == "cpu":
        a = np.abs(x.numpy())
        part = np.partition(a, n - k)  # NaNs order last, so a NaN anywhere lands in part[n-k:]
        top = part[n - k :]
        if not np.isfinite(top).all():
            raise ValueError(f"tensor {name!r}: top-k cannot select among NaN or infinite values")
        t = top[0]
        strict = np.flatnonzero(a > t)
        need = k - strict.size
        if need:
            strict = np.sort(np.concatenate([strict, np.flatnonzero(a == t)[:need]]))
        return torch.from_numpy(strict.astype(np.int64, copy=False))
    return _topk_positions_torch(x, k, name)


def _topk_positions_torch(x: torch.Tensor, k: int, name: str) -> torch.Tensor:
    """:func:`topk_positions` for any device (``1 <= k <= numel``); the same selection."""
    a = x.abs()
    if bool(torch.isnan(a).any()):
        raise ValueError(f"tensor {name!r}: top-k cannot select among NaN or infinite values")
    top = torch.topk(a, k, sorted=False).values
    if not bool(torch.isfinite(top).all()):
        raise ValueError(f"tensor {name!r}: top-k cannot select among NaN or infinite values")
    t = top.min()
    strict = (a > t).nonzero().view(-1)
    need = k - strict.numel()
    if need:
        strict = torch.cat([strict, (a == t).nonzero().view(-1)[:need]]).sort().values
    return strict


def check_positions(idx: torch.Tensor, ranges: Sequence[Range], name: str) -> None:
    """Raise :class:`PayloadError` unless every position of ``idx`` (int64) lies inside one of
    the sorted, disjoint ``ranges`` and no range holds more than its ``k`` positions."""
    idx = idx.reshape(-1).to(torch.int64).cpu()
    if not ranges:
        if idx.numel():
            raise PayloadError(name, f"{idx.numel()} positions where no range was allocated")
        return
    starts = torch.tensor([r[0] for r in ranges], dtype=torch.int64)
    stops = torch.tensor([r[1] for r in ranges], dtype=torch.int64)
    ks = torch.tensor([r[2] for r in ranges], dtype=torch.int64)
    which = torch.searchsorted(starts, idx, right=True) - 1  # the range starting at or before
    inside = (which >= 0) & (idx < stops[which.clamp(min=0)])
    if not bool(inside.all()):
        bad = int(idx[~inside][0])
        raise PayloadError(name, f"position {bad} is outside the allocated ranges")
    counts = torch.bincount(which, minlength=len(ranges))
    over = (counts > ks).nonzero().view(-1)
    if over.numel():
        j = int(over[0])
        s, e, k = ranges[j]
        raise PayloadError(name, f"{int(counts[j])} positions in range [{s}, {e}) allocated k = {k}")


def _normalize_ranges(ranges: Iterable[Any]) -> tuple[Range, ...]:
    out: list[Range] = []
    for r in ranges:
        if not isinstance(r, (list, tuple)) or len(r) != 3:
            raise ConfigError(f"ranges: each range is (start, stop, k), got {r!r}")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in r):
            raise ConfigError(f"ranges: start, stop and k must be integers, got {r!r}")
        s, e, k = (int(v) for v in r)
        if not (0 <= s < e and 0 <= k <= e - s):
            raise ConfigError(f"ranges: need 0 <= start < stop and 0 <= k <= stop - start, got {r!r}")
        if out and s < out[-1][1]:
            raise ConfigError(f"ranges: must be sorted and disjoint, {r!r} after {out[-1]!r}")
        out.append((s, e, k))
    return tuple(out)


class TopK(Codec):
    """Keep the largest-magnitude entries of a tensor, exactly, with their values.

    ``p`` (in ``(0, 1]``): plain top-k of the whole tensor, ``k = max(1, round(p * numel))``.
    ``ranges``: DEFT's selection, the top ``k`` inside each ``[start, stop)`` and nothing else
    (sorted, disjoint, ``0 <= k <= stop - start``; ``stop`` must not exceed the tensor's
    ``numel`` at encode time). Exactly one of the two is given. ``values``: "float32" or
    "float16" on the wire.

    A decoder built with ``ranges`` also checks that the message keeps to them (a hostile client
    cannot send more than it was allocated); one built with ``p`` accepts any valid message.
    """

    codec_id = "topk"
    version = 1

    def __init__(
        self,
        p: float | None = None,
        ranges: Iterable[Sequence[int]] | None = None,
        values: str = "float32",
    ) -> None:
        if (p is None) == (ranges is None):
            raise ConfigError("p: give exactly one of p and ranges")
        if p is not None:
            p = check_number("p", p, low=0.0, high=1.0)
        if values not in VALUE_ENCODINGS:
            raise ConfigError(f"values: must be one of {list(VALUE_ENCODINGS)}, got {values!r}")
        self.p = None if p is None else float(p)
        self.ranges = None if ranges is None else _normalize_ranges(ranges)
        self.values = values

    def _params(self) -> dict[str, Any]:
        ranges = None if self.ranges is None else [list(r) for r in self.ranges]
        return {"p": self.p, "ranges": ranges, "values": self.values}

    # --- encoding -----------------------------------------------------------------------------

    def select(self, flat: torch.Tensor, name: str = "") -> torch.Tensor:
        """Ascending positions this codec keeps in the flat float32 tensor ``flat``."""
        n = flat.numel()
        if self.ranges is None:
            assert self.p is not None
            return topk_positions(flat, max(1, round(self.p * n)), name)
        if self.ranges and self.ranges[-1][1] > n:
            raise ConfigError(f"ranges: stop {self.ranges[-1][1]} exceeds tensor {name!r}'s {n} elements")
        parts = [topk_positions(flat[s:e], k, name).add_(s) for s, e, k in self.ranges if k]
        if not parts:
            return torch.zeros(0, dtype=torch.int64, device=flat.device)
        return torch.cat(parts)  # ranges are sorted and disjoint: already ascending

    def _encode(self, flat: torch.Tensor, name: str) -> tuple[Payload, torch.Tensor | None]:
        return sparse_payload(flat, self._sent_positions(flat, name), self.values)

    def encode_sparse(
        self, tensor: torch.Tensor, name: str = ""
    ) -> tuple[EncodedTensor, np.ndarray, np.ndarray] | None:
        """:meth:`encode`, with what the receiver will decode said sparsely: the kept positions
        (ascending int64, into the flattened tensor) and their float32 values as decoded (zeros
        elsewhere), for error feedback and a client's pending update
        (:class:`fedcomp.methods.sent.KeptValues`). None off CPU."""
        if tensor.device.type != "cpu":
            return None
        check_wire_dtype(tensor, name)
        flat = self._flatten(tensor, name)
        idx = self._sent_positions(flat, name)
        payload, vals = sparse_payload_values(flat, idx, self.values)
        return self._envelope(tensor, name, payload), idx.numpy(), vals.numpy()

    def _sent_positions(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        idx = self.select(flat, name).to(flat.device)
        # A tensor with fewer than k non-zeros (a frozen layer, a sparse update) would send zeros
        # among the k largest: they decode to nothing, so only the non-zero ones are sent.
        if idx.numel():
            kept = flat.index_select(0, idx) != 0
            if not bool(kept.all()):
                idx = idx[kept]
        return idx

    # --- decoding -----------------------------------------------------------------------------

    def _decode(self, payload: Payload, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        return decode_sparse_payload(self._checked(payload, spec), spec, device, ranges=self.ranges)

    def decode_sparse(self, payload: Payload, spec: TensorSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder without its dense output (on the CPU): the kept positions (strictly
        ascending int64) and their float32 values, after every payload check of :meth:`decode`
        but the envelope's (a server summing replies adds these instead of materialising)."""
        return decode_sparse_values(self._checked(payload, spec), spec, torch.device("cpu"), ranges=self.ranges)

    def _checked(self, payload: Payload, spec: TensorSpec) -> SparsePayload:
        name = spec.name
        expect_payload(payload, SparsePayload, name)
        assert isinstance(payload, SparsePayload)
        if payload.value_encoding != self.values:
            raise PayloadError(name, f"value encoding {payload.value_encoding!r} where {self.values!r} was expected")
        return payload
