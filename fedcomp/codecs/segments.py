"""Per-tensor work over one flat buffer on a GPU, at the speed of a pass over memory.

The whole-update engines (:mod:`fedcomp.codecs.sbc_device`, :mod:`fedcomp.codecs.threelc_device`)
lay an update's tensors back to back and need, per value, its tensor's threshold or scale, and per
tensor, the largest magnitude. torch's own operators for both are slow when the segments are few
and long, as an update's are (ResNet-50: 161 tensors, the largest 2.4M values): on an H200,
``repeat_interleave`` built its 25.6M-entry index in 1.39 ms (a thread per segment) where a pass
over the same memory takes tens of microseconds, a third of an SBC encode's GPU time and half a 3LC
encode's (two of them); ``segment_reduce`` took 0.58 ms (a block per segment).

- :func:`segment_ids`: each value's tensor index, as a running sum of a marker at each tensor's
  start (a fill, a scatter of a few hundred entries, a scan): every value's threshold is then one
  gather (``thresholds[ids]``).
- :func:`segment_max`: the largest value of each tensor in two segmented reductions, the first over
  pieces of at most :data:`PIECE` values (every block does a like share), the second over each
  tensor's pieces. A maximum is exact in any order.

The tables these need depend on the layout alone and are kept per layout and device (a sender
meets the same layout every round); they hold a few hundred integers, never one per value.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from fedcomp.codecs.flat import to_device

#: The first reduction's piece length: about a GPU block's fair share of a large tensor.
PIECE = 1 << 16


@dataclass(frozen=True)
class _Tables:
    starts: torch.Tensor  # where a new tensor begins (int64, each position once), after the first
    steps: torch.Tensor  # how many tensors begin there (int32: empty tensors begin where the next does)
    pieces: torch.Tensor  # lengths of the pieces, tensor by tensor (int64)
    per_tensor: torch.Tensor  # how many pieces each tensor has (int64)


@lru_cache(maxsize=16)
def _tables(numels: tuple[int, ...], device: str) -> _Tables:
    n = np.array(numels, dtype=np.int64)
    total = int(n.sum())
    begins = np.cumsum(n)[:-1]  # tensor i + 1 begins here
    inside = begins[begins < total]
    starts, steps = np.unique(inside, return_counts=True)
    per_tensor = -(-n // PIECE)  # ceil; 0 for an empty tensor
    pieces = np.full(int(per_tensor.sum()), PIECE, dtype=np.int64)
    last = np.cumsum(per_tensor)[per_tensor > 0] - 1
    pieces[last] = n[per_tensor > 0] - (per_tensor[per_tensor > 0] - 1) * PIECE
    dev = torch.device(device)
    return _Tables(
        to_device(starts.astype(np.int64), dev),
        to_device(steps.astype(np.int32), dev),
        to_device(pieces, dev),
        to_device(per_tensor, dev),
    )


def segment_tables(numels: tuple[int, ...], device: torch.device) -> object:
    """The per-layout tables :func:`segment_max` reads on ``device`` (kept for the last sixteen
    layouts; what a CUDA graph of its reductions holds on to)."""
    return _tables(numels, str(device))


def segment_ids(numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """For each of the ``sum(numels)`` values laid back to back, the index of its tensor (int32,
    on ``device``); what ``torch.arange(len(numels)).repeat_interleave(numels)`` gives. Kept for
    the last two layouts and devices (read only: shared): four bytes a value on the device, against
    three launches a call (on a GPU host each launch is tens of microseconds of the host's time)."""
    return _segment_ids(numels, str(device))


@lru_cache(maxsize=2)
def _segment_ids(numels: tuple[int, ...], device: str) -> torch.Tensor:
    t = _tables(numels, device)
    marks = torch.zeros(sum(numels), dtype=torch.int32, device=device)
    marks.index_put_((t.starts,), t.steps)
    return marks.cumsum(0, dtype=torch.int32)


def segment_max(values: torch.Tensor, numels: tuple[int, ...]) -> torch.Tensor:
    """The largest of each tensor's values in flat ``values`` (NaN where a NaN is, as
    ``torch.segment_reduce``), in two balanced reductions instead of one block per tensor."""
    t = _tables(numels, str(values.device))
    # ``unsafe``: the lengths are the layout's own, so the operator's checks of them (a ``min``
    # and an ``all`` read back to the host: on a GPU two waits for the device each) are skipped.
    by_piece = torch.segment_reduce(values, "max", lengths=t.pieces, unsafe=True)
    return torch.segment_reduce(by_piece, "max", lengths=t.per_tensor, unsafe=True)
