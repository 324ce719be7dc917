"""What a receiver will decode of an update, kept by the sender: dense, or sparse where the codec
says what it keeps.

A client keeps what it sent until the server says whether it was aggregated (protocol 2,
:class:`fedcomp.flower.pending.PendingUpdate`). For an SBC tensor that is one value at a few
positions; holding it as a dense tensor cost a ResNet-50 client a tensor of the model's size
filled, subtracted from the residual, scanned for its non-zeros and checked for finiteness every
message (about 40 ms of its 225 on the 2-core build machine, ``bench rounds``).
:class:`KeptValues` holds the positions and the value instead; :func:`dense` gives the tensor
where one is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["KeptValues", "Sent", "dense"]


@dataclass(frozen=True, eq=False)
class KeptValues:
    """A float32 tensor of ``shape`` that is ``value`` at ``positions`` (ascending, distinct int64
    indices into the flattened tensor) and zero elsewhere: what SBC's receiver decodes
    (:meth:`fedcomp.codecs.sbc.SBC.encode_sparse`)."""

    shape: tuple[int, ...]
    positions: np.ndarray
    value: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def nonzero(self) -> tuple[np.ndarray, np.ndarray]:
        """The positions of the non-zero values and those values (float32), ascending: what
        ``flat.nonzero()`` and ``flat[nz]`` give of the dense tensor (none where the value is
        zero, either sign; every position where it is NaN)."""
        if self.value == 0.0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        return self.positions, np.full(self.positions.shape[0], self.value, dtype=np.float32)

    def sum_of_squares(self) -> float:
        """``sum(x ** 2)`` over the dense tensor, in float64 (the square of a float32 is exact
        there; NaN or inf where the value is not finite and at some position)."""
        count = self.positions.shape[0]
        return float(count) * float(np.float32(self.value)) ** 2 if count else 0.0

    def dense(self, device: torch.device | str = "cpu") -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.float32)
        if self.positions.shape[0]:
            out[torch.from_numpy(self.positions)] = float(np.float32(self.value))
        return out.reshape(self.shape).to(device)


#: One tensor of what was sent: dense (float32), or :class:`KeptValues`.
Sent = torch.Tensor | KeptValues


def dense(sent: Sent, device: torch.device | str | None = None) -> torch.Tensor:
    """``sent`` as a float32 tensor (on ``device`` when given; a dense one stays where it is)."""
    if isinstance(sent, KeptValues):
        return sent.dense("cpu" if device is None else device)
    t = sent.to(torch.float32)
    return t if device is None else t.to(device)
