"""What a receiver will decode of an update, kept by the sender: dense, or sparse where the codec
says what it keeps.

A client keeps what it sent until the server says whether it was aggregated (protocol 2,
:class:`fedcomp.flower.pending.PendingUpdate`). For a tensor coded by SBC, STC or top-k (DEFT's
codec) that is a few positions and their values; holding it as a dense tensor cost a ResNet-50
client a tensor of the model's size filled, subtracted from the residual, scanned for its
non-zeros and checked for finiteness every message (with SBC: about 40 ms of its 225 on the
2-core build machine, ``bench rounds``). :class:`KeptValues` holds the positions and values
instead (what the codecs' ``encode_sparse`` returns); :func:`dense` gives the tensor where one is
needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp.wire.payloads import EncodedTensor

__all__ = ["KeptValues", "Sent", "dense", "encode_kept"]


@dataclass(frozen=True, eq=False)
class KeptValues:
    """A float32 tensor of ``shape`` that is ``values`` at ``positions`` (ascending, distinct
    int64 indices into the flattened tensor) and zero elsewhere: what SBC's, STC's or top-k's
    receiver decodes. ``values``: one float32 value for every position (SBC's mean), or a float32
    array of one value per position."""

    shape: tuple[int, ...]
    positions: np.ndarray
    values: float | np.ndarray

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def nonzero(self) -> tuple[np.ndarray, np.ndarray]:
        """The positions of the non-zero values and those values (float32), ascending: what
        ``flat.nonzero()`` and ``flat[nz]`` give of the dense tensor (no zero of either sign;
        every NaN)."""
        if not isinstance(self.values, np.ndarray):
            if self.values == 0.0:
                return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
            return self.positions, np.full(self.positions.shape[0], self.values, dtype=np.float32)
        keep = self.values != 0
        if keep.all():
            return self.positions, self.values
        return self.positions[keep], self.values[keep]

    def sum_of_squares(self) -> float:
        """``sum(x ** 2)`` over the dense tensor, in float64 (a float32's square is exact there;
        NaN or inf where a value at some position is not finite)."""
        count = self.positions.shape[0]
        if not count:
            return 0.0
        if not isinstance(self.values, np.ndarray):
            return float(count) * float(np.float32(self.values)) ** 2
        wide = self.values.astype(np.float64)
        return float(np.dot(wide, wide))

    def dense(self, device: torch.device | str = "cpu") -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.float32)
        if self.positions.shape[0]:
            at = torch.from_numpy(self.positions)
            if isinstance(self.values, np.ndarray):
                out[at] = torch.from_numpy(self.values)
            else:
                out[at] = float(np.float32(self.values))
        return out.reshape(self.shape).to(device)


#: One tensor of what was sent: dense (float32), or :class:`KeptValues`.
Sent = torch.Tensor | KeptValues


def encode_kept(codec: object, tensor: torch.Tensor, name: str) -> tuple[EncodedTensor, KeptValues] | None:
    """``codec``'s encoding of ``tensor`` and what the receiver will decode as
    :class:`KeptValues`, where the codec says what it keeps (``encode_sparse``: SBC, STC, top-k)
    of a contiguous float32 CPU tensor; None elsewhere (the caller encodes densely)."""
    sparse = getattr(codec, "encode_sparse", None)
    if sparse is None or tensor.device.type != "cpu" or tensor.dtype != torch.float32 or not tensor.is_contiguous():
        return None
    found = sparse(tensor.detach(), name)
    if found is None:
        return None
    enc, positions, values = found
    return enc, KeptValues(tuple(tensor.shape), positions, values)


def dense(sent: Sent, device: torch.device | str | None = None) -> torch.Tensor:
    """``sent`` as a float32 tensor (on ``device`` when given; a dense one stays where it is)."""
    if isinstance(sent, KeptValues):
        return sent.dense("cpu" if device is None else device)
    t = sent.to(torch.float32)
    return t if device is None else t.to(device)
