"""The streaming path's running weighted sum of replies (:class:`CompressionStrategy`'s streaming
aggregation, described in ``strategy.py``): each reply is checked, then added into float64 sums,
and dropped.

A reply of the base uplink method (SBC's kept positions and one value per tensor, small tensors
dense fp32; top-k's and STC's positions and values) is read by :func:`sparse_delta` without a
dense tensor of its own: with the C kernel (:class:`fedcomp.codecs.scatter_sum.ScatterSum`), one
call decodes every tensor's SBC positions into one scratch array and checks every dense value
(finite) while it sums the squared norm, and one more call adds the reply into the sums (a
scatter-add per SBC tensor); top-k and STC tensors are added by NumPy. Measured on ResNet-50
replies (p = 0.01, 161 tensors of which 84 dense): the per-tensor path spent about 24 ms per reply
on the decode, the checks and the adds, the kernel path 8 ms; 1000 replies aggregate in 15-17 s
instead of 28-32 s (``python -m fedcomp.bench server``; BENCHMARKS.md). Without the kernel the
per-tensor path runs (NumPy and torch); the two give the same sums for SBC tensors bit for bit,
and for dense tensors up to float64 rounding (tested).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fedcomp.codecs import TensorSpec, scatter_sum
from fedcomp.codecs.base import Codec
from fedcomp.codecs.dense import DenseFP32
from fedcomp.codecs.sbc import SBC
from fedcomp.errors import PayloadError, shown
from fedcomp.methods.base import SentTerm
from fedcomp.wire.payloads import DensePayload, EncodedUpdate


@dataclass
class ReplyDelta:
    """One reply's delta against the global model W, checked (finite, well formed) and ready to
    add: the tensors the kernel adds (``kernel``) and the others (``terms``). ``squares`` is its
    squared norm."""

    terms: dict[str, SentTerm] = field(default_factory=dict)
    kernel: scatter_sum.ScatterSum | None = None
    squares: float = 0.0

    @property
    def norm(self) -> float:
        return float(self.squares**0.5)

    def parts(self) -> Iterator[tuple[str, np.ndarray | None, np.ndarray | float]]:
        """Every tensor the reply changes, as ``(name, positions, values)`` into the flattened
        tensor: positions ``None`` for a dense tensor; values one float (SBC's) or an array."""
        if self.kernel is not None:
            yield from self.kernel.parts()
        for name, term in self.terms.items():
            if isinstance(term, tuple):
                idx, value = term
                yield name, idx.numpy(), value.numpy() if isinstance(value, torch.Tensor) else value
            else:
                flat = term.detach().reshape(-1)
                yield name, None, (flat if flat.dtype in (torch.float32, torch.float64) else flat.float()).numpy()


def sparse_delta(
    update: EncodedUpdate, specs: Sequence[TensorSpec], accepted: Mapping[str, Codec], kernel: bool = True
) -> ReplyDelta:
    """What the base method's ``decode`` decodes (``decode_update`` with the ``accepted`` codecs:
    the round's and dense fp32), with the same checks and errors, but SBC tensors as their kept
    positions and one value, top-k and STC ones (float32) as their positions and values, never
    expanded. ``kernel=False`` takes the per-tensor path (tests)."""
    if len(update.tensors) != len(specs):
        raise PayloadError("", f"update has {len(update.tensors)} tensors, expected {len(specs)}")
    out = ReplyDelta()
    fused = scatter_sum.ScatterSum() if kernel and scatter_sum.available() else None
    for spec, enc in zip(specs, update.tensors, strict=True):
        if enc.name != spec.name:
            raise PayloadError(spec.name, f"found tensor {shown(enc.name)} in its place")
        codec = accepted.get(enc.codec_id)
        if codec is None:
            raise PayloadError(spec.name, f"codec {enc.codec_id!r} is not accepted here ({sorted(accepted)})")
        if isinstance(codec, SBC):
            codec.check_envelope(enc, spec)
            if fused is None:
                out.terms[spec.name] = codec.positions(enc.payload, spec, torch.device("cpu"))
                continue
            nnz, b, bits, value = codec.checked_positions(enc.payload, spec)
            if nnz:
                fused.positions(spec.name, bits, nnz, b, spec.numel, value)
        elif hasattr(codec, "decode_sparse") and spec.dtype == torch.float32:
            # Top-k, STC: a dense decode would allocate and zero a tensor of the model's size per reply.
            codec.check_envelope(enc, spec)
            out.terms[spec.name] = codec.decode_sparse(enc.payload, spec)
        elif fused is not None and type(codec) is DenseFP32 and spec.dtype == torch.float32:
            codec.check_envelope(enc, spec)
            payload = codec.checked_payload(enc.payload, spec)
            assert isinstance(payload, DensePayload)
            fused.values(spec.name, payload.data, spec.numel)
        else:
            out.terms[spec.name] = codec.decode(enc, spec)
    if fused is not None and fused.tasks:
        out.squares = fused.check()
        out.kernel = fused
    out.squares += _check_terms(out.terms)
    return out


def _check_terms(terms: Mapping[str, SentTerm]) -> float:
    """The squared norm of the per-tensor terms, after checking their values are finite (a sparse
    term's values are finite by its decoder's checks; an SBC one's squared norm is
    ``nnz * value**2``)."""
    squares = 0.0
    for name, term in terms.items():
        if isinstance(term, tuple):
            idx, value = term
            if isinstance(value, torch.Tensor):
                squares += float(value.double().pow(2).sum())
            else:
                squares += idx.numel() * value * value
        elif not bool(torch.isfinite(term).all()):
            raise PayloadError(name, "decoded values are not all finite")
        else:
            squares += float(term.double().pow(2).sum())
    return squares


@dataclass
class Contribution:
    """One decoded train reply on the streaming path: its delta against the global model W (it
    stands for ``W + delta``), or the arrays its uplink method decodes to (GradiVeQ's coefficients,
    DEFT's ``W + delta``), whichever the method gives."""

    delta: ReplyDelta | None = None
    arrays: dict[str, torch.Tensor] | None = None


class WeightedSum:
    """The running weighted sum of the replies, in float64, one tensor per name allocated on its
    first use; a delta reply adds ``weight * delta`` (a scatter-add for SBC) and ``weight`` to the
    weight of the base ``W``. In float64 the order and number of replies change the mean by no
    more than float64 rounding, far below the float32 the model is kept in."""

    def __init__(self, base: dict[str, torch.Tensor]) -> None:
        self.base = base
        self.sums: dict[str, torch.Tensor] = {}
        self._flat: dict[str, np.ndarray] = {}  # the sums as flat NumPy views, for the kernel
        self.base_weight = 0.0
        self.weight = 0.0

    def _sum(self, name: str, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        out = self.sums.get(name)
        if out is None:
            out = self.sums[name] = torch.zeros(shape, dtype=torch.float64)
        return out

    def _flat_sum(self, name: str) -> np.ndarray:
        out = self._flat.get(name)
        if out is None:
            out = self._flat[name] = self._sum(name, self.base[name].shape).view(-1).numpy()
        return out

    def add(self, part: Contribution, weight: float) -> None:
        delta = part.delta
        if delta is not None:
            if delta.kernel is not None:
                delta.kernel.add_into(weight, [self._flat_sum(name) for name in delta.kernel.names])
            for name, term in delta.terms.items():
                acc = self._sum(name, self.base[name].shape)
                if isinstance(term, tuple):
                    idx, value = term
                    if idx.numel():  # the decoder's positions are strictly ascending, so unique:
                        add = weight * (value.numpy().astype(np.float64) if isinstance(value, torch.Tensor) else value)
                        acc.view(-1).numpy()[idx.numpy()] += add  # a fancy add, not add.at
                else:
                    acc.add_(term.reshape(acc.shape), alpha=weight)
            self.base_weight += weight
        if part.arrays is not None:
            for name, t in part.arrays.items():
                self._sum(name, t.shape).add_(t, alpha=weight)
        self.weight += weight

    def mean(self) -> dict[str, torch.Tensor]:
        """The weighted mean, float32, in the base's order (then any other names); the sums are
        released as it goes."""
        names = dict.fromkeys([*(self.base if self.base_weight else ()), *self.sums])
        share = self.base_weight / self.weight  # exactly 1.0 when every reply was a delta
        out = {}
        for name in names:
            acc = self.sums.pop(name, None)
            self._flat.pop(name, None)
            m = acc.div_(self.weight) if acc is not None else torch.zeros(self.base[name].shape, dtype=torch.float64)
            if share:
                m.add_(self.base[name], alpha=share)
            out[name] = m.to(torch.float32)
        return out
