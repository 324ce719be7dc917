"""3LC over a whole update on any torch device, in a number of kernel launches, host syncs and
copies that does not grow with the number of tensors (issue #13's whole-update engine: the
server's downlink when its model lives on a GPU, and the client's decoding of it there).

The update is one flat buffer (:class:`fedcomp.codecs.flat.Layout`):

- **Encode** (:func:`encode_update`): every tensor's ``max|T|`` in two balanced segmented
  reductions (:func:`fedcomp.codecs.segments.segment_max`); the scales ``m`` on the device
  (:func:`fedcomp.codecs.threelc.scale_for`'s float32 arithmetic, as every path, with no sync);
  ``q = round(T / m)`` for all values in one true division by each value's own scale (gathered by
  the values' tensor indices, :func:`fedcomp.codecs.segments.segment_ids`, no sync), so the bytes
  are those of the per-tensor division; the base-3^5 packing of every byte's five digits (``k * G
  + j`` of its tensor, ``G = ceil(n / 5)``) by one gather of a per-layout table of their places and
  one matrix-vector product with the digits' weights; every tensor's zero runs coded on the
  device too (:func:`_zero_runs`: running counts and positions in blocks of fixed size); the
  streams, their lengths, the scales and the per-tensor maxima (whose finiteness is the update's)
  to the host in one copy (the only wait), where each stream is sliced out. The reconstruction
  ``m * q``, when asked for (error feedback), is one multiply. About fifty launches in all (on a
  GPU host each costs tens of microseconds of the host's time whatever its size), which on CUDA
  are one replay of a graph from a layout's second encode on (:mod:`fedcomp.codecs.graphs`).
- **Decode** (:func:`decode_into`): the payloads are checked on the host (:class:`StreamBatch`:
  every stream by one call of the C kernel, ``check_many``; :meth:`ThreeLC.literals` tensor by
  tensor without it) and their streams go to the device as received, with a few numbers per
  tensor, in one copy (:func:`fedcomp.codecs.flat.to_device_many`, with the update's other tensors
  where :mod:`fedcomp.methods.flat_update` decodes it); there each byte's group comes from a
  running sum of the groups the bytes stand for (a zero run, several), and one scatter writes
  every byte's five digits times the scale into zeros (:func:`decode_on_device`).

Bytes, reconstructions and decoded values are the per-tensor path's (tested on CPU, where the
same torch operators run). A value that is not finite makes :func:`encode_update` return None
(the per-tensor path then raises naming the tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from fedcomp import _native
from fedcomp.codecs.base import TensorSpec
from fedcomp.codecs.flat import (
    Layout,
    has_nonzero_static,
    host_side,
    position_dtype,
    to_device,
    to_device_many,
    to_host_later,
)
from fedcomp.codecs.graphs import GraphCache, Outputs
from fedcomp.codecs.sbc import team_threads
from fedcomp.codecs.segments import segment_ids, segment_max, segment_tables
from fedcomp.codecs.threelc import (
    _F32_MAX,
    MAX_RUN,
    RUN_BASE,
    WEIGHTS,
    ZERO_GROUP,
    ThreeLC,
    _zero_run_encode_np,
    groups,
)
from fedcomp.errors import PayloadError
from fedcomp.wire.payloads import EncodedTensor, Payload, ThreeLCPayload, filled

_KERNEL = _native.load("threelc")


@lru_cache(maxsize=2)
def _packing(numels: tuple[int, ...], offsets: tuple[int, ...], device: str) -> torch.Tensor:
    """For each packed byte of the whole update, the flat positions of its five digits (``k * G +
    j`` of its tensor, ``G = ceil(n / 5)``), part by part (``(5, bytes)``: the product that packs
    them then reads the five parts of consecutive bytes side by side); a padding digit (past its
    tensor's end) points at ``total``, one past the update, where the quantized values' buffer
    holds -1 (digit 0). Int32 where the positions fit, flat; kept per layout (a sender meets the
    same layout every round; four bytes a value on the device)."""
    counted = _group_counts(numels)
    g = counted.counts
    total = int(sum(numels))
    seg = np.repeat(np.arange(len(numels)), g)
    j = np.arange(int(g.sum()), dtype=np.int64) - np.asarray(counted.starts, dtype=np.int64)[seg]
    inside = j[:, None] + g[seg][:, None] * np.arange(5, dtype=np.int64)  # k * G + j, per byte
    at = np.where(
        inside < np.asarray(numels, dtype=np.int64)[seg][:, None],
        inside + np.asarray(offsets, dtype=np.int64)[seg][:, None],
        total,
    )
    return to_device(np.ascontiguousarray(at.T).reshape(-1).astype(position_dtype(total + 1)), torch.device(device))


#: Each digit's weight in its byte, as a float32 vector (a matrix-vector product packs the bytes).
_WEIGHTS = torch.tensor(WEIGHTS, dtype=torch.float32)
#: ``sum(WEIGHTS)``: the byte of five digits 1 (five zeros), what weighted ``q`` (-1, 0, 1) add to.
_ZERO_BYTE = float(sum(WEIGHTS))


@lru_cache(maxsize=8)
def _weights(device: str) -> torch.Tensor:
    return _WEIGHTS.to(device)


def encode_update(
    codec: ThreeLC,
    tensors: Sequence[tuple[str, torch.Tensor]],
    flat: torch.Tensor | None = None,
    want_recon: bool = False,
    layout: Layout | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[list[EncodedTensor], torch.Tensor | None] | None:
    """Encode float32 ``tensors`` (one device, each of at least one value) as :meth:`ThreeLC.encode`
    would, one by one; with ``want_recon`` also what the receiver decodes,
    back to back in one float32 buffer. ``flat``: the tensors already laid out back to back (as
    ``layout``, their :meth:`Layout.of`, where the caller has it). ``meanwhile``: host work to do
    while the device works (called once, before the host waits for it). None where a value is not
    finite."""
    layout = Layout.of(tensors) if layout is None else layout
    if flat is None:
        flat = torch.cat([t.detach().reshape(-1) for _, t in tensors])
    s = float(np.float32(codec.s))
    on_device = codec.zero_run and ZERO_RUNS_ON_DEVICE

    def fn(f: torch.Tensor) -> Outputs:
        return _device_part(s, on_device, layout, want_recon, f)

    key = (layout, s, codec.zero_run, on_device, want_recon, flat.device)
    with GRAPHS.run(key, fn, (flat,), lambda: _tables(layout, flat.device)) as replayed:
        made, _ = replayed if replayed is not None else fn(flat)
        copy = to_host_later(made[0])
        recon = made[1] if want_recon else None
        if replayed is not None and recon is not None:  # (the graph's buffer: the next encode writes it)
            recon = recon.clone()
        if meanwhile is not None:
            meanwhile()
        both = copy.wait()
    n_t = len(layout.numels)
    head = both[: 12 * n_t].view(np.float32)
    if not np.isfinite(head[n_t : 2 * n_t]).all():
        return None
    with host_side():
        scales, lengths = head[:n_t], head[2 * n_t :].view(np.int32)
        streams = both[12 * n_t :]
        if codec.zero_run and not on_device:
            bodies = _bodies(streams, layout.numels)
        else:
            bodies = [
                streams[a : a + n].tobytes()
                for a, n in zip(_group_counts(layout.numels).starts, lengths.tolist(), strict=True)
            ]
        zero_run = codec.zero_run
        encoded = codec._float32_envelopes(
            layout.names,
            layout.shapes,
            [  # (by filled: what ThreeLCPayload(...) makes, in half the time, one a tensor a round)
                filled(ThreeLCPayload, {"scale": scale, "numel": n, "zero_run": zero_run, "data": body})
                for n, scale, body in zip(layout.numels, scales.tolist(), bodies, strict=True)
            ],
        )
    return encoded, recon


#: The device part of the encodes, as CUDA graphs (:mod:`fedcomp.codecs.graphs`).
GRAPHS = GraphCache("3LC whole-update encode")


def _tables(layout: Layout, dev: torch.device) -> tuple[object, ...]:
    """The per-layout tables :func:`_device_part` reads (kept with its graph)."""
    return (
        segment_tables(layout.numels, dev),
        segment_ids(layout.numels, dev),
        _packing(layout.numels, layout.offsets, str(dev)),
        _weights(str(dev)),
        _run_tables(layout.numels, str(dev)),
    )


#: Whether the encode codes the zero runs on the device (:func:`_zero_runs`), else on the host
#: after its copy (the C kernel's ``zero_runs_many``, on the CPU threads). On an H200 the device's
#: coding kept the GPU about 0.65 ms longer for a ResNet-50 update, where the host's took 0.6 ms of
#: the encode's 3.3 ms, and 3.5 ms (of 7.4) once rounds of error feedback had filled the update
#: (fewer zero groups): the device's then took 4.6 ms in all.
ZERO_RUNS_ON_DEVICE = True


def _device_part(s: float, code_runs: bool, layout: Layout, want_recon: bool, flat: torch.Tensor) -> Outputs:
    """Everything the encode does on the device before its copy to the host: the scales, the
    maxima, each tensor's stream length and the streams (zero-run coded where ``code_runs``) laid
    out for one copy; the reconstruction where asked for (else None). Every operator here is a
    launch and, on a GPU host, tens of microseconds of the host's time whatever its size: on CUDA
    they are replayed as one graph (:data:`GRAPHS`)."""
    dev, total = flat.device, layout.total
    top = segment_max(flat.abs(), layout.numels)  # NaN or inf where a value is not finite
    # scale_for on the device: float32(s) * max|T| in float32 arithmetic (exact: s is a float32),
    # an infinite product clamped to the float32 maximum.
    m = (top * s).clamp_(max=_F32_MAX)
    # Division by each value's own scale (never a multiplication by 1 / m: the per-tensor bytes);
    # a tensor whose scale is 0 is all zeros: divided by 1 instead, every q is 0.
    by_value = m.masked_fill(m == 0, 1.0)[segment_ids(layout.numels, dev)]
    qs = torch.empty(total + 1, dtype=torch.float32, device=dev)
    q = torch.div(flat, by_value, out=qs[:total]).round_().add_(0.0)  # -0.0 -> +0.0
    qs[total:].fill_(-1.0)  # what a padding digit reads: digit 0
    recon = q * by_value if want_recon else None  # (q is 0 where the scale is 0: m * q either way)
    del by_value
    # The base-3^5 packing: every byte's five q by one gather, weighted and summed by one product.
    digits = torch.index_select(qs, 0, _packing(layout.numels, layout.offsets, str(dev))).view(5, -1)
    packed = torch.mv(digits.t(), _weights(str(dev))).add_(_ZERO_BYTE).to(torch.uint8)
    del qs, q, digits
    # the scales, the maxima (whose finiteness is the update's), each tensor's stream length and the
    # streams in one copy to the host
    runs = _run_tables(layout.numels, str(dev))
    streams, lengths = _zero_runs(packed, runs) if code_runs else (packed, runs.counts)
    both = torch.cat([m.view(torch.uint8), top.view(torch.uint8), lengths.view(torch.uint8), streams])
    return ((both,) if recon is None else (both, recon)), None


@dataclass(frozen=True)
class _RunTables:
    """Per layout, on the device, what :func:`_zero_runs` reads beside its packed bytes (``G`` in
    all, the tensors' back to back): about 0.9 bytes a value."""

    at: torch.Tensor  # (G,) int32: each byte's index
    starts: torch.Tensor  # (G,) bool: the byte starts its tensor
    inner_starts: torch.Tensor  # (G,) bool: the byte starts a tensor other than the first
    byte_tensor: torch.Tensor  # (G,) int32: the byte's tensor
    lasts: torch.Tensor  # (tensors,) int64: each tensor's last byte
    starts_less_1: torch.Tensor  # (tensors,) int32: where each tensor's bytes start, less 1
    counts: torch.Tensor  # (tensors,) int32: each tensor's bytes (its stream's length uncoded)
    piece: torch.Tensor  # (15,) uint8: the byte of a piece of 1-14 bytes 121


@lru_cache(maxsize=2)
def _run_tables(numels: tuple[int, ...], device: str) -> _RunTables:
    g = _group_counts(numels)
    dev = torch.device(device)
    counts = g.counts
    starts, ends = np.asarray(g.starts, dtype=np.int64), np.asarray(g.ends, dtype=np.int64)
    n = int(counts.sum())
    first = np.zeros(n, dtype=np.uint8)
    first[starts[counts > 0]] = 1
    inner = first.copy()
    inner[0] = 0
    piece = np.array([0, ZERO_GROUP] + [RUN_BASE + r - 2 for r in range(2, MAX_RUN + 1)], dtype=np.uint8)
    parts = to_device_many(
        [
            ([np.arange(n, dtype=np.int32)], np.int32),
            ([first], np.uint8),
            ([inner], np.uint8),
            ([np.repeat(np.arange(len(numels), dtype=np.int32), counts)], np.int32),
            ([ends - 1], np.int64),
            ([starts - 1], np.int32),
            ([counts], np.int32),
            ([piece], np.uint8),
        ],
        dev,
    )
    empty = torch.zeros(0, dtype=torch.uint8, device=dev)
    at, first_t, inner_t, tensor, lasts, starts_less_1, counts_t, piece_t = (empty if p is None else p for p in parts)
    return _RunTables(
        at, first_t.view(torch.bool), inner_t.view(torch.bool), tensor, lasts, starts_less_1, counts_t, piece_t
    )


def _zero_runs(packed: torch.Tensor, t: _RunTables) -> tuple[torch.Tensor, torch.Tensor]:
    """Every tensor's zero-run coding (:func:`fedcomp.codecs.threelc.zero_run_encode`) of its
    packed bytes, on the device, with no wait: each tensor's stream from where its packed bytes
    start (compacted in place; the bytes past it unused), and the streams' lengths (int32).

    A run of ``L`` bytes 121 (five zeros; a run ends with its tensor) is coded as pieces of 14
    from its start, the last of 1-14 bytes: a piece of 1 is the byte 121 itself, of ``r`` >= 2
    the byte ``241 + r`` (255 for 14). So a byte of a run is sent where its place in the run is a
    multiple of 14, as the piece that starts there (``min(14, bytes left in the run)``); any
    other byte as it is. A byte's place and the bytes left come from where the marks before and
    after it lie (a byte not in a run, or a tensor's start): a running count of the marks and
    their positions in a block of fixed size (``nonzero_static``), where each sent byte goes from
    a running count of them. Scans, gathers and a scatter only: ``torch.cummax`` and ``cummin``,
    which would say the same in fewer operators, took an H200 27 ms here."""
    n = packed.shape[0]
    zero = packed == ZERO_GROUP
    literal = zero.logical_not()
    # a run begins after a byte not in a run, or at its tensor's start: the byte before it
    marks = literal | t.starts
    at_mark = nonzero_static(marks, n, 0)
    before = at_mark - zero[at_mark].to(torch.int64)  # (a mark that is itself in a run: the byte before)
    # its distance from that byte: 0 for a byte not in a run, its place in the run plus 1 for one in a run
    d = t.at - before[marks.cumsum(0, dtype=torch.int32).sub_(1)]
    sent = torch.where(zero, d.remainder_(MAX_RUN) == 1, True)
    # a run ends before a byte not in a run, or a tensor's start (the last tensor's: at n)
    ends_at = literal | t.inner_starts
    at_end = nonzero_static(ends_at, n + 1, n)
    left = (at_end[ends_at.cumsum(0, dtype=torch.int32)] - t.at).clamp_(max=MAX_RUN)  # bytes of its run from it on
    value = torch.where(zero, t.piece[left], packed)
    count = sent.cumsum(0, dtype=torch.int32)  # sent bytes up to and including each
    ends = count[t.lasts]
    sent_before = torch.nn.functional.pad(ends[:-1], (1, 0))  # sent before each tensor's bytes
    where = torch.where(sent, count + (t.starts_less_1 - sent_before)[t.byte_tensor], n)
    out = torch.empty(n + 1, dtype=torch.uint8, device=packed.device)
    out.index_put_((where,), value)
    return out[:n], ends - sent_before


def nonzero_static(mask: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    """The positions where ``mask`` holds, ascending, in a block of ``size`` (int64), ``fill``
    past them: ``torch.nonzero_static`` (no wait for the device), or where this torch lacks it on
    the device (torch 2.4's CUDA) ``nonzero`` padded (a wait; a CUDA graph then fails to capture
    and the encode runs eagerly)."""
    if has_nonzero_static(mask.device.type):
        return torch.nonzero_static(mask, size=size, fill_value=fill).squeeze(1)
    found = mask.nonzero().squeeze(1)
    return torch.nn.functional.pad(found, (0, size - found.shape[0]), value=fill)


def _bodies(data: np.ndarray, numels: tuple[int, ...]) -> list[bytes]:
    """Each tensor's zero-run coding of its packed bytes (``data``, back to back), on the host:
    by one call of the C kernel for all tensors where it is built (the tensors spread over the CPU
    threads), else tensor by tensor in NumPy (the same bytes)."""
    g = _group_counts(numels)
    if _KERNEL is None:
        return [_zero_run_encode_np(data[a:b]).tobytes() for a, b in zip(g.starts, g.ends, strict=True)]
    out = np.empty(data.shape[0], dtype=np.uint8)
    lengths = np.empty(len(numels), dtype=np.int64)
    _KERNEL.zero_runs_many(data, g.counts, out, lengths, *team_threads())
    return [out[a : a + n].tobytes() for a, n in zip(g.starts, lengths.tolist(), strict=True)]


@dataclass(frozen=True)
class _GroupCounts:
    counts: np.ndarray  # int64: each tensor's groups
    starts: list[int]  # where each tensor's packed bytes start, and end
    ends: list[int]


@lru_cache(maxsize=8)
def _group_counts(numels: tuple[int, ...]) -> _GroupCounts:
    counts = np.array([groups(n) for n in numels], dtype=np.int64)
    counts.flags.writeable = False  # (kept and shared: read only)
    ends = np.cumsum(counts)
    return _GroupCounts(counts, (ends - counts).tolist(), ends.tolist())


@dataclass(frozen=True)
class Streams:
    """Some tensors' checked 3LC streams, for :func:`decode_on_device` (:meth:`StreamBatch.streams`).

    The streams go to the device as received (a zero-run coded update is a few bytes a thousand
    values: 0.6 MB for a ResNet-50 update where its groups other than 121 with their places were
    14.5 MB), with a table of a few numbers per tensor; the device expands the runs itself."""

    #: Each tensor's stream, as received (``uint8``; views of the payloads' bytes).
    data: list[np.ndarray]
    #: ``(4, tensors)`` int64, a column per tensor: where its groups end counted over the streams'
    #: groups back to back; its offset in the flat buffer less where its groups start; its groups
    #: ``G``; its end in the flat buffer.
    table: np.ndarray
    #: Each tensor's scale, float32.
    scales: np.ndarray


class StreamBatch:
    """3LC payloads of an update, each :meth:`add` ed after the checks that need no decoding, then
    every stream checked at once (:meth:`streams`: by one call of the C kernel, ``check_many``,
    or tensor by tensor by :meth:`ThreeLC.literals` without it) and handed over as received."""

    def __init__(self) -> None:
        self._tasks: list[tuple[bytes | bytearray, bool, int]] = []
        self._meta: list[tuple[ThreeLC, Payload, TensorSpec]] = []
        self._offsets: list[int] = []
        self._scales: list[float] = []

    def __len__(self) -> int:
        return len(self._tasks)

    def add(self, codec: ThreeLC, payload: Payload, spec: TensorSpec, offset: int) -> bool:
        """Check ``payload`` as :meth:`ThreeLC.checked_stream` does (raising its
        :class:`PayloadError`) and keep it for :meth:`streams`, its tensor at ``offset`` in the flat
        buffer; False (and nothing kept) where its scale is beyond float32 (the dense path, which
        decodes it as :meth:`ThreeLC.decode` does, takes it)."""
        data, scale = codec.checked_stream(payload, spec)  # (scale: finite, >= 0)
        if scale >= _F32_OVERFLOW:  # float32(scale) would be infinite (a NumPy cast, without errstate)
            return False
        assert isinstance(payload, ThreeLCPayload)
        self._tasks.append((data, payload.zero_run, groups(spec.numel)))
        self._meta.append((codec, payload, spec))
        self._offsets.append(offset)
        self._scales.append(scale)  # (rounded to float32 with the others, by :meth:`streams`)
        return True

    def streams(self) -> Streams:
        """The streams added, once every one is valid; else raise the :class:`PayloadError` of the
        first that is not, in the words of :meth:`ThreeLC.literals`. Allocates a few numbers per
        tensor (the streams are views of the payloads)."""
        if _KERNEL is not None:
            bad = _KERNEL.check_many(self._tasks)
        else:
            bad = -1
            for codec, payload, spec in self._meta:
                codec.literals(payload, spec)  # (raises, naming what is wrong)
        if bad >= 0:
            codec, payload, spec = self._meta[bad]
            codec.literals(payload, spec)  # raises, naming what is wrong
            raise PayloadError(spec.name, "invalid 3LC stream")
        g = np.array([t[2] for t in self._tasks], dtype=np.int64)
        offsets = np.array(self._offsets, dtype=np.int64)
        numels = np.array([spec.numel for _, _, spec in self._meta], dtype=np.int64)
        ends = np.cumsum(g)
        table = np.stack([ends, offsets - (ends - g), g, offsets + numels])
        data = [np.frombuffer(t[0], dtype=np.uint8) for t in self._tasks]
        return Streams(data, table, np.array(self._scales, dtype=np.float32))


#: The least float64 that rounds to an infinite float32 (half an ulp past its maximum, the tie
#: rounding away to the even 2**128).
_F32_OVERFLOW = 2.0**128 - 2.0**103


def available() -> bool:
    """Whether the C kernel behind the zero-run coding of :func:`encode_update` and the checks of
    :meth:`StreamBatch.streams` is built and enabled (without it both run in NumPy and Python)."""
    return _KERNEL is not None


def decode_into(flat: torch.Tensor, streams: Streams) -> None:
    """Write the tensors' decoded values into ``flat`` (zeros at the tensors' places): the
    groups of ``streams``, copied to ``flat``'s device in one copy, then :func:`decode_on_device`."""
    data, table, scales = to_device_many(stream_groups(streams), flat.device)
    if data is not None and table is not None and scales is not None:
        decode_on_device(flat, data, table, scales)


def stream_groups(streams: Streams | None) -> list[tuple[list[np.ndarray], type]]:
    """:func:`fedcomp.codecs.flat.to_device_many`'s groups of ``streams`` (none: three empty
    groups), the three arguments of :func:`decode_on_device`."""
    if streams is None:
        return [([], np.uint8), ([], np.int64), ([], np.float32)]
    return [(streams.data, np.uint8), ([streams.table.reshape(-1)], np.int64), ([streams.scales], np.float32)]


@lru_cache(maxsize=8)
def _byte_tables(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per stream byte ``b``: its five digits less one (-1, 0 or 1), part 0 first, as float32
    (zeros for a run, 243-255, whose groups are 121s), and the groups it stands for (1, or a
    run's 2-14)."""
    b = np.arange(256)
    digits = np.stack([(b // w) % 3 - 1 for w in WEIGHTS], axis=1).astype(np.float32)
    digits[RUN_BASE:] = 0.0
    counts = np.where(b >= RUN_BASE, b - (RUN_BASE - 2), 1).astype(np.int64)
    # (constants made once per device: not the engine's copies)
    return torch.from_numpy(digits).to(device), torch.from_numpy(counts).to(device)


_PARTS = torch.arange(5)


@lru_cache(maxsize=8)
def _parts(device: str) -> torch.Tensor:
    return _PARTS.to(device)


def decode_on_device(flat: torch.Tensor, data: torch.Tensor, table: torch.Tensor, scales: torch.Tensor) -> None:
    """:func:`decode_into` of streams already on ``flat``'s device (checked: :meth:`StreamBatch.streams`):
    their bytes back to back, the table (flat) and the scales of :class:`Streams`. Each byte's
    group by a running sum of the groups the bytes stand for, its tensor by a search of the
    groups' ends, and all five digits of every byte in one scatter: about fifteen launches whatever
    the number of tensors (seventeen). A run writes five zeros at its first group's places (its groups are
    121s: zeros); a group's padding digits (past its tensor's end) are written at its part-0 place
    with its part-0 digit's value, so the scatter's repeated places all get one value and ``flat``
    can be the receiver's buffer (no spare value)."""
    dev = str(flat.device)
    digit_values, group_counts = _byte_tables(dev)
    byte = data.long()
    count = group_counts[byte]
    group = count.cumsum(0).sub_(count)  # each byte's first group, over the streams back to back
    columns = table.view(4, -1)
    tensor = torch.searchsorted(columns[0], group, right=True)
    shift, step, end = columns[1:].index_select(1, tensor)  # each byte's tensor's
    first = group.add_(shift)  # the place of the group's part-0 digit
    at = (step[:, None] * _parts(dev)).add_(first[:, None])  # first + k * G
    inside = at < end[:, None]
    value = digit_values[byte].mul_(scales[tensor][:, None])  # -1, 0 or 1 times the scale
    at = torch.where(inside, at, first[:, None])
    value = torch.where(inside, value, value[:, :1])
    flat.index_put_((at.view(-1),), value.view(-1))
