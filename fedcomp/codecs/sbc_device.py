"""SBC over a whole update on any torch device, in a number of kernel launches, host syncs and
copies that does not grow with the number of tensors (issue #13's whole-update engine; what a
client whose model lives on a GPU runs).

:meth:`fedcomp.codecs.sbc.SBC.encode` on a CUDA tensor costs about fifteen launches, several
copies and syncs per tensor; a ResNet-50 update is 161 tensors. Here the update is one flat
buffer (:class:`fedcomp.codecs.flat.Layout`) and every step runs once for all of it:

1. **Fast mode** (tensors above ``sample_size`` values): one gather of every tensor's sample
   (the same positions as :func:`fedcomp.codecs.sbc._sample_positions`, a row per tensor), one
   sort of the rows, the two order statistics read off by column, each value compared with its
   tensor's thresholds (gathered by the values' tensor indices,
   :func:`fedcomp.codecs.segments.segment_ids`: no sync), both comparisons into one ``2 x N``
   mask and one ``nonzero``: the candidates of every tensor, both sides.
2. **Exact mode** (the small tensors; all of them in ``mode="exact"``; a fast-mode tensor whose
   side came back empty or over ``2 k``): the tensors as the rows of a padded matrix (chunks of
   about ``_EXACT_BUDGET`` values), one stable sort per side per chunk: the first ``k`` of a row
   are its ``k`` most extreme values, ties to the lowest index, as on CPU.
3. The candidates come to the host in a few copies; there, per tensor and in NumPy, the exact
   means, the side (:func:`fedcomp.codecs.sbc.choose_side`) and the Golomb code, as on CPU.

The bytes are :meth:`SBC.encode`'s (tested against it on CPU, where these same operators run).
A value that is not finite anywhere in the update makes :func:`encode_update` return None: the
caller then encodes tensor by tensor, whose errors name the tensor (on CPU, and for a NaN that
fast mode neither samples nor selects, :meth:`SBC.encode` says nothing; this engine then leaves
the tensor to it too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from fedcomp.codecs.flat import Layout, host_side, to_device, to_host
from fedcomp.codecs.golomb import encode_positions, golomb_b
from fedcomp.codecs.sbc import SBC, _sample_positions_np, choose_side, choose_sides
from fedcomp.codecs.segments import segment_ids
from fedcomp.wire.payloads import EncodedTensor, SBCPayload

#: Exact mode's padded matrices hold at most about this many values per chunk (a single tensor
#: larger than it is a chunk of its own).
_EXACT_BUDGET = 1 << 24


@dataclass(frozen=True)
class FlatEncoding:
    """An update encoded by :func:`encode_update`."""

    #: One per tensor, in the layout's order.
    encoded: list[EncodedTensor]
    #: The kept positions of every tensor, into the flat buffer (ascending within a tensor).
    kept: np.ndarray
    #: The value the receiver decodes at each kept position (float32: the tensor's mean).
    value: np.ndarray


def encode_update(
    codec: SBC, tensors: Sequence[tuple[str, torch.Tensor]], flat: torch.Tensor | None = None
) -> FlatEncoding | None:
    """Encode float32 ``tensors`` (one device, each of at least one value) as :meth:`SBC.encode`
    would, one by one. ``flat``: the tensors already laid out back to back (e.g. an error
    feedback accumulator), else they are concatenated here. None where a value is not finite."""
    layout = Layout.of(tensors)
    if flat is None:
        flat = torch.cat([t.detach().reshape(-1) for _, t in tensors])
    device = flat.device
    plan = _plan(layout.numels, layout.offsets, codec.p, codec.sample_size, codec.mode, str(device))
    finite = torch.isfinite(flat).all()
    fast: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
    exact_rows = list(plan.exact)
    if plan.fast:
        candidates = _fast_candidates(flat, plan, codec, layout)
        for row in plan.fast:
            hi, _, lo, _ = candidates[row]
            k = plan.ks[row]
            if 0 < hi.shape[0] <= 2 * k and 0 < lo.shape[0] <= 2 * k:
                fast[row] = candidates[row]
            else:
                exact_rows.append(row)
    if not bool(to_host(finite)):
        return None
    picked = _exact_candidates(flat, layout, plan.ks, sorted(exact_rows))
    picked.update(fast)
    with host_side():
        return _finish(codec, tensors, layout, picked)


def _finish(
    codec: SBC,
    tensors: Sequence[tuple[str, torch.Tensor]],
    layout: Layout,
    picked: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
) -> FlatEncoding | None:
    """Per tensor, on the host: the side, the mean and the Golomb code of its candidates, all
    tensors in one call of the C kernel where it can (:func:`choose_sides`: on an H100 host this
    loop in Python was about half of an SBC encode's time), else one by one."""
    candidates = [picked[i] for i in range(len(tensors))]
    found = choose_sides(candidates, layout.numels)
    encoded: list[EncodedTensor] = []
    kept: list[np.ndarray] = []
    means: list[float] = []
    for i, (name, t) in enumerate(tensors):
        n = layout.numels[i]
        done = found[i]
        if done is not None:
            idx, mean, b, bits = done
        else:
            chosen = choose_side(*candidates[i])
            if chosen is None:  # (not after the finiteness check)
                return None
            side, mean = chosen
            assert isinstance(side, np.ndarray)
            idx = side
            b = golomb_b(idx.shape[0] / n)
            bits = encode_positions(torch.from_numpy(idx), b)
        encoded.append(codec._envelope(t, name, SBCPayload(mean=mean, golomb_b=b, nnz=int(idx.shape[0]), bits=bits)))
        kept.append(idx)
        means.append(mean)
    if not kept:
        return FlatEncoding(encoded, np.zeros(0, np.int64), np.zeros(0, np.float32))
    counts = np.array([k.shape[0] for k in kept], dtype=np.int64)
    flat_kept = np.concatenate(kept)  # (a new array: the positions into the flat buffer)
    flat_kept += np.repeat(np.array(layout.offsets, dtype=np.int64), counts)
    return FlatEncoding(encoded, flat_kept, np.repeat(np.array(means, dtype=np.float32), counts))


@dataclass(frozen=True)
class _Plan:
    """What :func:`encode_update` needs of a layout that does not depend on the values."""

    ks: tuple[int, ...]
    fast: tuple[int, ...]  # tensors in fast mode, in order
    exact: tuple[int, ...]  # the others
    where: torch.Tensor | None  # (len(fast), s) sample positions into the flat buffer
    fast_rows: torch.Tensor | None  # the fast tensors' indices, on the device


@lru_cache(maxsize=16)
def _plan(numels: tuple[int, ...], offsets: tuple[int, ...], p: float, s: int, mode: str, device: str) -> _Plan:
    ks = tuple(max(1, round(p * n)) for n in numels)
    fast = tuple(i for i, n in enumerate(numels) if mode == "fast" and n > s)
    fast_set = set(fast)
    exact = tuple(i for i in range(len(numels)) if i not in fast_set)
    dev = torch.device(device)
    where = fast_rows = None
    if fast:
        where = to_device(np.stack([_sample_positions_np(numels[i], s) + offsets[i] for i in fast]), dev)
        fast_rows = to_device(np.array(fast, dtype=np.int64), dev)
    return _Plan(ks, fast, exact, where, fast_rows)


#: Hits (``side * total + position``) travel to the host as int32 up to this (else int64).
_INT32_HITS = int(np.iinfo(np.int32).max)


def _fast_candidates(
    flat: torch.Tensor, plan: _Plan, codec: SBC, layout: Layout
) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per fast-mode tensor: the ascending positions (into the tensor) and values of
    ``x >= thr_hi`` and of ``x <= thr_lo``, the thresholds read off its sample."""
    assert plan.where is not None and plan.fast_rows is not None
    s = codec.sample_size
    r = max(1, round(codec.p * s))
    ordered = flat[plan.where].sort(dim=1).values  # a NaN sorts last; the caller drops the result
    count = len(layout.numels)
    thresholds = torch.empty((2, count), dtype=flat.dtype, device=flat.device)
    thresholds[0].fill_(float("inf"))  # no finite value is selected in an exact-mode tensor
    thresholds[1].fill_(float("-inf"))
    thresholds[0].index_copy_(0, plan.fast_rows, ordered[:, s - r])
    thresholds[1].index_copy_(0, plan.fast_rows, ordered[:, r - 1])
    ids = segment_ids(layout.numels, flat.device)
    mask = torch.empty((2, layout.total), dtype=torch.bool, device=flat.device)
    torch.ge(flat, thresholds[0][ids], out=mask[0])
    torch.le(flat, thresholds[1][ids], out=mask[1])
    del ids
    total = layout.total
    # side * total + position, ascending: the high side first. One copy to the host of these and
    # the values, four bytes each where they fit in int32: on an H100, copying (side, position)
    # int64 pairs and the values separately took about 5.3 of the encode's 8.3 ms of GPU time; this
    # takes it to 3.3 ms (the host's share of the encode, not the copy, sets its wall time).
    found = mask.view(-1).nonzero().squeeze(1)
    del mask
    vals_dev = flat[found.remainder(total)]
    if 2 * total <= _INT32_HITS:
        both = to_host(torch.cat([found.to(torch.int32), vals_dev.view(torch.int32)]))
        m = found.shape[0]
        hits, vals = both[:m].astype(np.int64), both[m:].view(np.float32)
    else:
        hits, vals = to_host(found), to_host(vals_dev)
    with host_side():
        n_hi = int(np.searchsorted(hits, total))
        pos = hits
        pos[n_hi:] -= total
        offsets = np.asarray(layout.offsets, dtype=np.int64)
        out: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        hi_cut = np.searchsorted(pos[:n_hi], offsets)
        lo_cut = np.searchsorted(pos[n_hi:], offsets) + n_hi
        ends = len(offsets)
        for row in plan.fast:
            h0, h1 = hi_cut[row], hi_cut[row + 1] if row + 1 < ends else n_hi
            l0, l1 = lo_cut[row], lo_cut[row + 1] if row + 1 < ends else pos.shape[0]
            off = offsets[row]
            out[row] = (pos[h0:h1] - off, vals[h0:h1], pos[l0:l1] - off, vals[l0:l1])
    return out


def _exact_candidates(
    flat: torch.Tensor, layout: Layout, ks: Sequence[int], rows: Sequence[int]
) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per tensor of ``rows``: the ascending positions and values of its ``k`` largest and of
    its ``k`` smallest values, ties to the lowest index (:func:`fedcomp.codecs.sbc._exact_select`
    on every device). Tensors of like size share a padded matrix."""
    out: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
    by_size = sorted(rows, key=lambda i: -layout.numels[i])
    start = 0
    while start < len(by_size):
        width = layout.numels[by_size[start]]
        end = start + 1
        while end < len(by_size) and (end - start + 1) * width <= _EXACT_BUDGET:
            end += 1
        chunk = by_size[start:end]
        out.update(_exact_chunk(flat, layout, ks, chunk, width))
        start = end
    return out


@lru_cache(maxsize=64)
def _chunk_meta(offsets: tuple[int, ...], numels: tuple[int, ...], ks: tuple[int, ...], device: str) -> torch.Tensor:
    """A chunk's offsets, sizes and ``k`` as one ``3 x rows`` tensor on ``device`` (kept: an
    encoder meets the same layout every round)."""
    return to_device(np.array([offsets, numels, ks], dtype=np.int64), torch.device(device))


def _exact_chunk(
    flat: torch.Tensor, layout: Layout, ks: Sequence[int], chunk: Sequence[int], width: int
) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    dev = flat.device
    offsets, numels, k = _chunk_meta(
        tuple(layout.offsets[i] for i in chunk),
        tuple(layout.numels[i] for i in chunk),
        tuple(ks[i] for i in chunk),
        str(dev),
    ).unbind(0)
    k_max = max(ks[i] for i in chunk)
    cols = torch.arange(width, device=dev)
    valid = cols < numels[:, None]
    values = flat[(offsets[:, None] + cols).masked_fill_(~valid, 0)]
    keep = cols[:k_max] < k[:, None]
    picked = []
    for largest, pad in ((True, float("-inf")), (False, float("inf"))):
        order = values.masked_fill(~valid, pad).sort(dim=1, descending=largest, stable=True).indices[:, :k_max]
        at = order.masked_fill_(~keep, width).sort(dim=1).values  # ascending; the unused at the end
        picked += [at, values.gather(1, at.clamp(max=width - 1))]
    positions = to_host(torch.stack([picked[0], picked[2]]))
    vals = to_host(torch.stack([picked[1], picked[3]]))
    out = {}
    for j, i in enumerate(chunk):
        kk = min(ks[i], layout.numels[i])
        out[i] = (positions[0, j, :kk], vals[0, j, :kk], positions[1, j, :kk], vals[1, j, :kk])
    return out
