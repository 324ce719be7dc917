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
   mask and one ``nonzero_static`` into a block of fixed size (2.5 times the hits expected, and a
   margin; no sync: a block that fills up is found again by ``nonzero``): the candidates of every
   tensor, both sides.
2. **Exact mode** (the small tensors; all of them in ``mode="exact"``): the tensors as the rows
   of a padded matrix (chunks of about ``_EXACT_BUDGET`` values) over their negations, one stable
   sort per chunk: the first ``k`` of a row are its ``k`` most extreme values, ties to the lowest
   index, as on CPU; each side's length is known (``k``), so they are laid out flat with no sync.
3. Both modes' candidates (flat positions; fast mode's counts), and the update's least and
   largest value (its finiteness) come to the host in one copy (four bytes a value where
   positions fit in int32), the only wait for the device in the encode (on an H200 each torch
   operator also costs the host tens of microseconds: about thirty here in all), laid out so
   that the host reads them where they land; there every tensor's side, exact
   mean and Golomb code, and the kept positions (in the same width) and values the error feedback
   needs, come from one call of the C kernel (:func:`fedcomp.codecs.sbc.choose_sides_flat`: no
   Python object per tensor but its result, no conversion of the positions), as on CPU. A
   fast-mode tensor whose side came back empty or over ``2 k`` goes through exact mode in a second
   pass (rare: a tensor of many ties).

On CUDA, steps 1 and 2 and the copy's layout are one replay of a graph from a layout's second
encode on (:mod:`fedcomp.codecs.graphs`; fast mode's block has a fixed size), and the caller's
``meanwhile`` (the update's small tensors, coded on the host) runs before the host waits.

The bytes are :meth:`SBC.encode`'s (tested against it on CPU, where these same operators run).
A value that is not finite anywhere in the update makes :func:`encode_update` return None: the
caller then encodes tensor by tensor, whose errors name the tensor (a NaN that fast mode neither
samples nor selects too: every scan of :meth:`SBC.encode` notes one since the twenty-first
session, on the CPU and on a device).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from fedcomp.codecs.flat import Layout, has_nonzero_static, host_side, position_dtype, to_device, to_host_later
from fedcomp.codecs.golomb import encode_positions, golomb_b
from fedcomp.codecs.graphs import GraphCache, Outputs
from fedcomp.codecs.sbc import SBC, _sample_positions_np, choose_side, choose_sides_flat, side_payload
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
    #: The kept positions of every tensor, into the flat buffer (ascending within a tensor; int32
    #: where the update's positions fit in it, else int64).
    kept: np.ndarray
    #: The value the receiver decodes at each kept position (float32: the tensor's mean).
    value: np.ndarray


def encode_update(
    codec: SBC,
    tensors: Sequence[tuple[str, torch.Tensor]],
    flat: torch.Tensor | None = None,
    layout: Layout | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> FlatEncoding | None:
    """Encode float32 ``tensors`` (one device, each of at least one value) as :meth:`SBC.encode`
    would, one by one. ``flat``: the tensors already laid out back to back (e.g. an error
    feedback accumulator; ``layout``, their :meth:`Layout.of`, where the caller has it), else they
    are concatenated here. ``meanwhile``: host work to do while the device works (called once,
    before the host first waits for it). None where a value is not finite."""
    layout = Layout.of(tensors) if layout is None else layout
    if flat is None:
        flat = torch.cat([t.detach().reshape(-1) for _, t in tensors])
    plan = _plan(layout.numels, layout.offsets, codec.p, codec.sample_size, codec.mode, str(flat.device))
    capacity = plan.capacity if has_nonzero_static(flat.device.type) else None
    got = _device_part_to_host(flat, layout, plan, capacity, meanwhile, (codec.p, codec.sample_size, codec.mode))
    if got is not None and plan.fast and capacity is not None and got.hits == capacity:  # (perhaps more: rare)
        got = _read(*_device_part(flat, plan, layout, None))
    if got is None:
        return None
    with host_side():
        exact_ranges = (
            _exact_layout(layout.offsets, layout.numels, plan.ks, plan.exact, str(flat.device))[1]
            if plan.exact
            else None
        )
        cands = _candidates(got, plan, layout, exact_ranges)
        redo = cands.redo(plan)
    if redo:  # fast-mode tensors whose side came back empty or over 2 k: exact mode
        more = _exact_select(flat, layout, plan.ks, redo)
        more_got = _read(*_for_host(None, more, None, layout.total))
        assert more_got is not None
        with host_side():
            cands = cands.with_exact(redo, more_got, more.ranges)
    with host_side():
        return _finish(codec, layout, plan, cands)


#: The device part of the encodes, as CUDA graphs (:mod:`fedcomp.codecs.graphs`).
GRAPHS = GraphCache("SBC whole-update encode")


def _device_part_to_host(
    flat: torch.Tensor,
    layout: Layout,
    plan: _Plan,
    capacity: int | None,
    meanwhile: Callable[[], None] | None,
    settings: tuple[float, int, str],
) -> _OnHost | None:
    """:func:`_device_part` and its one copy to the host, ``meanwhile`` run while the device
    works: on a CUDA device, from the layout's second encode on, by a replay of its graph (possible
    where fast mode's hits come in a block of fixed size: ``capacity``). ``settings``: the
    codec's, which with the layout make the plan."""
    if capacity is None:
        return _read(*_device_part(flat, plan, layout, capacity), meanwhile)

    def fn(f: torch.Tensor) -> Outputs:
        return _device_part(f, plan, layout, capacity)

    def keep() -> tuple[object, ...]:
        tables = (
            _exact_layout(layout.offsets, layout.numels, plan.ks, plan.exact, str(flat.device)) if plan.exact else None
        )
        return plan, tables, segment_ids(layout.numels, flat.device)

    with GRAPHS.run((layout, settings, capacity, flat.device), fn, (flat,), keep) as replayed:
        return _read(*(replayed if replayed is not None else fn(flat)), meanwhile)


def _device_part(flat: torch.Tensor, plan: _Plan, layout: Layout, capacity: int | None) -> Outputs:
    """Everything the encode does on the device before its copy to the host: exact mode's
    candidates, the update's least and largest value, fast mode's hits (in a block of ``capacity``
    where given), laid out for the copy by :func:`_for_host`."""
    exact = _exact_select(flat, layout, plan.ks, plan.exact) if plan.exact else None
    limits = torch.aminmax(flat)
    hits = _fast_hits(flat, plan, layout, capacity) if plan.fast else None
    return _for_host(hits, exact, limits, layout.total)


@dataclass(frozen=True)
class _OnHost:
    """What one copy brought to the host, views of it: fast mode's hits (flat positions, the high
    side's ascending, then the low side's; ``n_hi`` of the high side, ``hits`` in all), in a block
    of ``block`` entries (those past the hits unused), followed by exact mode's candidates (flat
    positions, as :func:`_exact_select` laid them out); their values. Positions are int32 where
    the update's fit (:func:`position_dtype`), else int64."""

    positions: np.ndarray
    values: np.ndarray
    hits: int
    n_hi: int
    block: int


@dataclass(frozen=True)
class _Sizes:
    """How :func:`_for_host` laid out what it copies: ``m`` fast hits (the block), ``n`` candidates
    in all, then the two counts where there are hits, the least and largest value where asked for."""

    m: int
    n: int
    counts: bool
    limits: bool


def _for_host(
    hits: _Hits | None,
    exact: _Exact | None,
    limits: tuple[torch.Tensor, torch.Tensor] | None,
    total: int,
) -> Outputs:
    """The fast hits, the exact candidates, the high side's count and the update's least and
    largest value (``limits``: not finite where a value is not) laid out on the device for one
    copy to the host (:func:`_read`): four bytes each where positions fit in int32 (on an H100,
    copying int64 positions and the values separately took about 5.3 of an encode's 8.3 ms of GPU
    time; this took it to 3.3 ms), so that the host reads them where they land (no conversion, no
    concatenation). Three launches whatever the parts (a cast and a concatenation each, on a GPU
    host tens of microseconds apiece)."""
    parts_i: list[torch.Tensor] = []
    parts_f: list[torch.Tensor] = []
    if hits is not None:
        parts_i.append(hits.positions)
        parts_f.append(hits.values)
    if exact is not None:
        parts_i.append(exact.positions)
        parts_f.append(exact.values)
    if hits is not None:
        parts_i.append(hits.counts)
    m = 0 if hits is None else int(hits.positions.shape[0])
    n = m + (0 if exact is None else int(exact.positions.shape[0]))
    if limits is not None:
        parts_f += [lim.reshape(1) for lim in limits]
    sizes = _Sizes(m, n, hits is not None, limits is not None)
    ints_dev = parts_i[0] if len(parts_i) == 1 else torch.cat(parts_i)  # (all int64 here)
    if position_dtype(total) is np.int32:
        return (torch.cat([ints_dev.to(torch.int32), *(t.view(torch.int32) for t in parts_f)]),), sizes
    return (ints_dev, torch.cat(parts_f)), sizes


def _read(made: tuple[torch.Tensor, ...], sizes: _Sizes, meanwhile: Callable[[], None] | None = None) -> _OnHost | None:
    """What :func:`_for_host` laid out, copied to the host (the encode's wait for the device;
    ``meanwhile`` run before it) and read where it landed. None where a value is not finite."""
    copies = [to_host_later(t) for t in made]
    if meanwhile is not None:
        meanwhile()
    n, n_ints = sizes.n, sizes.n + (2 if sizes.counts else 0)
    if len(copies) == 1:
        both = copies[0].wait()
        ints, floats = both[:n_ints], both[n_ints:].view(np.float32)
    else:
        ints, floats = copies[0].wait(), copies[1].wait()
    lims = floats[n : n + 2] if sizes.limits else None
    if lims is not None and not np.isfinite(lims).all():
        return None
    n_hi, n_hits = (int(ints[n]), int(ints[n + 1])) if sizes.counts else (0, 0)
    return _OnHost(ints[:n], floats[:n], n_hits, n_hi, sizes.m)


@dataclass(frozen=True)
class _Candidates:
    """Every tensor's candidates, flat: positions into the update's flat buffer (int32 or int64, as
    they came to the host) and their values (float32); tensor ``i``'s high side
    ``positions[ranges[i, 0]:ranges[i, 1]]``, its low side ``positions[ranges[i, 2]:ranges[i, 3]]``,
    each ascending."""

    positions: np.ndarray
    values: np.ndarray
    ranges: np.ndarray  # (tensors, 4) int64

    def redo(self, plan: _Plan) -> tuple[int, ...]:
        """The fast-mode tensors whose side is empty or holds more than ``2 k``: exact mode's."""
        if not plan.fast:
            return ()
        fast = np.asarray(plan.fast)
        r = self.ranges[fast]
        nh, nl = r[:, 1] - r[:, 0], r[:, 3] - r[:, 2]
        two_k = 2 * np.asarray(plan.ks, dtype=np.int64)[fast]
        bad = (nh == 0) | (nh > two_k) | (nl == 0) | (nl > two_k)
        return tuple(int(i) for i in fast[bad])

    def with_exact(self, rows: Sequence[int], got: _OnHost, exact_ranges: np.ndarray) -> _Candidates:
        """These candidates with ``rows``' replaced by exact mode's ``got`` (laid out as
        ``exact_ranges`` say, :class:`_Exact`)."""
        ranges = self.ranges.copy()
        ranges[list(rows)] = exact_ranges + self.positions.shape[0]
        return _Candidates(
            np.concatenate([self.positions, got.positions]), np.concatenate([self.values, got.values]), ranges
        )


def _candidates(got: _OnHost, plan: _Plan, layout: Layout, exact_ranges: np.ndarray | None) -> _Candidates:
    """The flat candidates of what :func:`_read` brought (fast hits first, then the exact rows'),
    read where they landed: only each tensor's ranges are worked out here."""
    positions, m, n_hi, block = got.positions, got.hits, got.n_hi, got.block
    ranges = np.zeros((len(layout.numels), 4), dtype=np.int64)
    if plan.fast:
        offsets = plan.offsets.astype(positions.dtype)  # (a search in int32 converts nothing)
        hi = np.searchsorted(positions[:n_hi], offsets)
        lo = np.searchsorted(positions[n_hi:m], offsets) + n_hi
        fast = np.asarray(plan.fast)
        ranges[fast, 0] = hi[fast]
        ranges[fast, 1] = np.append(hi[1:], n_hi)[fast]
        ranges[fast, 2] = lo[fast]
        ranges[fast, 3] = np.append(lo[1:], m)[fast]
    if exact_ranges is not None:
        ranges[list(plan.exact)] = exact_ranges + block
    return _Candidates(positions, got.values, ranges)


def _finish(codec: SBC, layout: Layout, plan: _Plan, cands: _Candidates) -> FlatEncoding | None:
    """Per tensor, on the host: the side, the mean and the Golomb code of its candidates, all
    tensors in one call of the C kernel (:func:`choose_sides_flat`, which also lays out the kept
    positions and values: on an H100 host the per-tensor Python of this step was about half of an
    SBC encode's time), else, for a tensor it leaves, in Python (:func:`choose_side`)."""
    found = choose_sides_flat(cands.positions, cands.values, cands.ranges, plan.offsets, plan.numels)
    payloads: list[SBCPayload] = []
    kept: list[np.ndarray] = []
    pos, vals = cands.positions, cands.values
    for i, (h0, h1, l0, l1) in enumerate(cands.ranges.tolist()):
        side = found.sides[i]
        if side is not None:
            mean, nnz, b, bits, positive = side
            if found.kept is None:
                kept.append(pos[h0:h1] if positive else pos[l0:l1])
        else:
            off = plan.offsets[i]
            chosen = choose_side(pos[h0:h1] - off, vals[h0:h1], pos[l0:l1] - off, vals[l0:l1])
            if chosen is None:  # (not after the finiteness check)
                return None
            idx, mean = chosen
            assert isinstance(idx, np.ndarray)
            nnz = int(idx.shape[0])
            b = golomb_b(nnz / layout.numels[i])
            bits = encode_positions(torch.from_numpy(idx), b)
            kept.append(idx + off)
        # (a mean of +0.0 sends no positions; the kept ones stay in ``kept``, where the residual
        # takes off -0.0 and the reconstruction writes +0.0: the same as not at all)
        payloads.append(side_payload(mean, b, nnz, bits))
    encoded = codec._float32_envelopes(layout.names, layout.shapes, payloads)
    if found.kept is not None and found.value is not None:
        return FlatEncoding(encoded, found.kept, found.value)
    counts = np.array([k.shape[0] for k in kept], dtype=np.int64)
    means = np.array([p.mean for p in payloads], dtype=np.float32)
    flat_kept = np.concatenate(kept) if kept else np.zeros(0, np.int64)
    return FlatEncoding(encoded, flat_kept, np.repeat(means, counts))


@dataclass(frozen=True)
class _Plan:
    """What :func:`encode_update` needs of a layout that does not depend on the values."""

    ks: tuple[int, ...]
    fast: tuple[int, ...]  # tensors in fast mode, in order
    exact: tuple[int, ...]  # the others
    where: torch.Tensor | None  # (len(fast), s) sample positions into the flat buffer
    fast_rows: torch.Tensor | None  # the fast tensors' indices, on the device
    over_4k: torch.Tensor | None  # (len(fast),) bool, on the device: the tensor has more than 4 k values
    ranks: torch.Tensor | None  # the two order statistics' columns in a sorted sample row: (s - r, r - 1)
    unbounded: torch.Tensor | None  # (tensors, 2) float32: inf, -inf (no value on either side)
    capacity: int  # fast mode's hits found without a wait: their expected count (2 k a tensor) and a margin
    edges: torch.Tensor | None  # (total, 2 total), int64: a hit's side is where it falls between them
    offsets: np.ndarray  # the layout's, int64
    numels: np.ndarray


@lru_cache(maxsize=16)
def _plan(numels: tuple[int, ...], offsets: tuple[int, ...], p: float, s: int, mode: str, device: str) -> _Plan:
    ks = tuple(max(1, round(p * n)) for n in numels)
    fast = tuple(i for i, n in enumerate(numels) if mode == "fast" and n > s)
    fast_set = set(fast)
    exact = tuple(i for i in range(len(numels)) if i not in fast_set)
    dev = torch.device(device)
    where = fast_rows = over_4k = ranks = unbounded = edges = None
    capacity = 0
    if fast:
        where = to_device(np.stack([_sample_positions_np(numels[i], s) + offsets[i] for i in fast]), dev)
        fast_rows = to_device(np.array(fast, dtype=np.int64), dev)
        over_4k = to_device(np.array([numels[i] > 4 * ks[i] for i in fast]), dev)
        r = max(1, round(p * s))
        ranks = to_device(np.array([s - r, r - 1], dtype=np.int64), dev)
        unbounded = to_device(np.tile(np.array([np.inf, -np.inf], dtype=np.float32), (len(numels), 1)), dev)
        total = sum(numels)
        capacity = min(2 * total, (5 * sum(ks[i] for i in fast)) // 2 + 4096)
        edges = to_device(np.array([total, 2 * total], dtype=np.int64), dev)
    offs, ns = np.array(offsets, dtype=np.int64), np.array(numels, dtype=np.int64)
    return _Plan(ks, fast, exact, where, fast_rows, over_4k, ranks, unbounded, capacity, edges, offs, ns)


@dataclass(frozen=True)
class _Hits:
    """Fast mode's hits on the device: flat positions (the high side's, ascending, then the low
    side's, then, in a block of fixed size, unused entries), their values, and how many are the
    high side's and how many hits there are (a two-value tensor: no sync)."""

    positions: torch.Tensor
    values: torch.Tensor
    counts: torch.Tensor


def _fast_hits(flat: torch.Tensor, plan: _Plan, layout: Layout, capacity: int | None) -> _Hits:
    """On the device, every fast-mode tensor's values ``x >= thr_hi`` and ``x <= thr_lo``, the
    thresholds read off its sample: about fifteen launches whatever the number of tensors (on a
    GPU host each is tens of microseconds of the host's time). With ``capacity``, the first that
    many hits in a block of that size, found without a wait for the device (``nonzero_static``;
    the caller sees from the count whether the block filled up, then asks again without it: a
    ``nonzero``, whose size the host waits for)."""
    assert plan.where is not None and plan.fast_rows is not None and plan.over_4k is not None
    assert plan.ranks is not None and plan.unbounded is not None and plan.edges is not None
    ordered = flat[plan.where].sort(dim=1).values  # a NaN sorts last; the caller drops the result
    pair = ordered.index_select(1, plan.ranks)  # (fast tensors, 2): thr_hi, thr_lo
    # Where the thresholds meet (a frozen layer's zeros), every value is on a side, so with more
    # than 4 k values one side holds over 2 k: fast mode fails there whatever the scan finds. It
    # then finds nothing (not the whole tensor, copied to the host), and exact mode takes the
    # tensor on the second pass, as the CPU does. Exact-mode tensors and doomed ones get infinite
    # bounds: no finite value is selected there.
    doomed = (pair[:, 0] <= pair[:, 1]).logical_and_(plan.over_4k)
    pair = torch.where(doomed[:, None], plan.unbounded[:1], pair)
    bounds = plan.unbounded.index_copy(0, plan.fast_rows, pair)  # (tensors, 2)
    per_value = bounds.index_select(0, segment_ids(layout.numels, flat.device))  # (values, 2)
    mask = torch.empty((2, layout.total), dtype=torch.bool, device=flat.device)
    torch.ge(flat, per_value[:, 0], out=mask[0])
    torch.le(flat, per_value[:, 1], out=mask[1])
    del per_value
    if capacity is None:
        found = mask.view(-1).nonzero().squeeze(1)  # side * total + position, ascending
    else:  # (the unused entries: 2 total, past both sides; position 0)
        found = torch.nonzero_static(mask.view(-1), size=capacity, fill_value=2 * layout.total).squeeze(1)
    del mask
    positions = found.remainder(layout.total)
    return _Hits(positions, flat[positions], torch.searchsorted(found, plan.edges))


@dataclass(frozen=True)
class _Exact:
    """Exact mode's candidates of some tensors, on the device: flat positions (ascending within a
    side) and values; ``ranges`` (one row per tensor, in the order asked for) as in
    :class:`_Candidates`, into these."""

    positions: torch.Tensor
    values: torch.Tensor
    ranges: np.ndarray


def _exact_select(flat: torch.Tensor, layout: Layout, ks: Sequence[int], rows: Sequence[int]) -> _Exact:
    """Per tensor of ``rows``: the ascending positions and values of its ``k`` largest and of its
    ``k`` smallest values, ties to the lowest index (:func:`fedcomp.codecs.sbc._exact_select` on
    every device), laid out flat on the device with no sync (each side's length is known: ``k``,
    or the whole tensor). Tensors of like size share a padded matrix."""
    chunks, ranges = _exact_layout(layout.offsets, layout.numels, tuple(ks), tuple(rows), str(flat.device))
    parts = [_exact_chunk(flat, chunk) for chunk in chunks]
    positions = parts[0] if len(parts) == 1 else torch.cat(parts)
    return _Exact(positions, flat[positions], ranges)


@dataclass(frozen=True)
class _Chunk:
    """Tensors of like size that exact mode sorts as the rows of one padded matrix."""

    width: int  # the widest tensor's values
    k_max: int
    # On the device, for the matrix of the rows' values (rows, width) over their negations:
    idx: torch.Tensor  # (rows, width): each row's flat positions, 0 past its tensor's end
    padding: torch.Tensor  # (2 rows, width) bool: past the row's tensor's end
    unused: torch.Tensor  # (2 rows, k_max) bool: past the row's k
    offsets: torch.Tensor  # (2 rows, 1): the row's tensor's offset
    take: torch.Tensor  # where each row's first min(k, size) entries lie in a (2 rows, k_max) matrix


@lru_cache(maxsize=8)
def _exact_layout(
    offsets: tuple[int, ...], numels: tuple[int, ...], ks: tuple[int, ...], rows: tuple[int, ...], device: str
) -> tuple[list[_Chunk], np.ndarray]:
    """The chunks of ``rows`` (at most about ``_EXACT_BUDGET`` values each; a tensor larger than
    that is a chunk of its own) and where each row's sides lie in their concatenated output: per
    chunk, every row's high side, then every row's low side (kept: an encoder meets the same
    layout every round; a chunk's tables on the device are about a byte and a half for each of
    its matrix's values, a launch saved for each)."""
    dev = torch.device(device)
    by_size = sorted(rows, key=lambda i: -numels[i])
    chunks: list[_Chunk] = []
    ranges = np.zeros((len(rows), 4), dtype=np.int64)
    where = {row: j for j, row in enumerate(rows)}
    start = at = 0
    while start < len(by_size):
        width = numels[by_size[start]]
        end = start + 1
        while end < len(by_size) and (end - start + 1) * width <= _EXACT_BUDGET:
            end += 1
        chunk = by_size[start:end]
        kk = np.array([min(ks[i], numels[i]) for i in chunk], dtype=np.int64)
        k_max = max(ks[i] for i in chunk)
        firsts = np.concatenate(([0], np.cumsum(kk)[:-1]))
        take = np.concatenate([j * k_max + np.arange(n) for j, n in enumerate(kk)])
        offs = np.array([offsets[i] for i in chunk], dtype=np.int64)
        sizes = np.array([numels[i] for i in chunk], dtype=np.int64)
        padding = np.arange(width) >= sizes[:, None]
        idx = np.where(padding, 0, offs[:, None] + np.arange(width)).astype(
            position_dtype(max(offsets[i] + numels[i] for i in chunk))
        )
        unused = np.arange(k_max) >= np.array([ks[i] for i in chunk])[:, None]
        chunks.append(
            _Chunk(
                width,
                k_max,
                to_device(idx, dev),
                to_device(np.concatenate([padding, padding]), dev),
                to_device(np.concatenate([unused, unused]), dev),
                to_device(np.concatenate([offs, offs])[:, None], dev),
                to_device(np.concatenate([take, take + len(chunk) * k_max]), dev),
            )
        )
        side = int(kk.sum())
        for j, i in enumerate(chunk):
            ranges[where[i]] = (
                at + firsts[j],
                at + firsts[j] + kk[j],
                at + side + firsts[j],
                at + side + firsts[j] + kk[j],
            )
        at += 2 * side
        start = end
    return chunks, ranges


def _exact_chunk(flat: torch.Tensor, chunk: _Chunk) -> torch.Tensor:
    """One chunk's sides on the device: flat positions, the rows' high sides, then their low
    sides. The low side is the high side of the negated values (ties to the lowest
    index either way: a stable sort keeps equal keys in place), so both sides are one sort of a
    matrix of twice the rows: about eight launches a chunk."""
    values = flat.index_select(0, chunk.idx.view(-1)).view(chunk.idx.shape)
    both = torch.cat([values, values.neg()]).masked_fill_(chunk.padding, float("-inf"))
    order = both.sort(dim=1, descending=True, stable=True).indices[:, : chunk.k_max]
    at = order.masked_fill_(chunk.unused, chunk.width).sort(dim=1).values  # ascending; the unused at the end
    return (at + chunk.offsets).view(-1)[chunk.take]
