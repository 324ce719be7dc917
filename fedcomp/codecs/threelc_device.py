"""3LC over a whole update on any torch device, in a number of kernel launches, host syncs and
copies that does not grow with the number of tensors (issue #13's whole-update engine: the
server's downlink when its model lives on a GPU, and the client's decoding of it there).

The update is one flat buffer (:class:`fedcomp.codecs.flat.Layout`):

- **Encode** (:func:`encode_update`): every tensor's ``max|T|`` in one segmented reduction; the
  scales ``m`` on the host (:func:`fedcomp.codecs.threelc.scale_for`, float32 arithmetic, as
  every path); ``q = round(T / m)`` for all values in one true division by each value's own
  scale (spread by ``repeat_interleave``, no sync), so the bytes are those of the per-tensor
  division; the base-3^5 packing of every tensor's five parts by five gathers over the
  packed bytes of the whole update (a byte's five digits sit at ``k * G + j`` of its tensor,
  ``G = ceil(n / 5)``); the packed bytes to the host in one copy, where each tensor's zero runs
  are coded. The reconstruction ``m * q``, when asked for (error feedback), is one multiply.
- **Decode** (:func:`decode_into`): the payloads are checked on the host and reduced to their
  groups other than 121 (:meth:`ThreeLC.literals`); those bytes, with where each lands, go to
  the device in three copies, and five scatters write their digits times the scale into zeros.

Bytes, reconstructions and decoded values are the per-tensor path's (tested on CPU, where the
same torch operators run). A value that is not finite makes :func:`encode_update` return None
(the per-tensor path then raises naming the tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from fedcomp.codecs.base import TensorSpec
from fedcomp.codecs.flat import Layout, host_side, to_device, to_host
from fedcomp.codecs.threelc import WEIGHTS, ThreeLC, _zero_run_encode_np, groups, scale_for
from fedcomp.wire.payloads import EncodedTensor, Payload, ThreeLCPayload


@dataclass(frozen=True)
class _Groups:
    """Per packed byte of the whole update, what its five digits need, on the device."""

    first: torch.Tensor  # flat position of its digit in part 0 (offset + j)
    step: torch.Tensor  # its tensor's G
    end: torch.Tensor  # its tensor's end in the flat buffer


@lru_cache(maxsize=8)
def _groups(numels: tuple[int, ...], offsets: tuple[int, ...], device: str) -> _Groups:
    """:class:`_Groups` of a layout (kept: a sender meets the same layout every round)."""
    g = np.array([groups(n) for n in numels], dtype=np.int64)
    starts = np.array(offsets, dtype=np.int64)
    byte_starts = np.cumsum(np.concatenate(([0], g[:-1])))
    seg = np.repeat(np.arange(len(numels)), g)
    j = np.arange(int(g.sum()), dtype=np.int64) - byte_starts[seg]
    dev = torch.device(device)
    table = to_device(np.stack([starts[seg] + j, g[seg], starts[seg] + np.array(numels, dtype=np.int64)[seg]]), dev)
    first, step, end = table.unbind(0)
    return _Groups(first, step, end)


def encode_update(
    codec: ThreeLC,
    tensors: Sequence[tuple[str, torch.Tensor]],
    flat: torch.Tensor | None = None,
    want_recon: bool = False,
) -> tuple[list[EncodedTensor], torch.Tensor | None] | None:
    """Encode float32 ``tensors`` (one device, each of at least one value) as
    :meth:`ThreeLC.encode` would, one by one; with ``want_recon`` also what the receiver decodes,
    back to back in one float32 buffer. ``flat``: the tensors already laid out back to back. None
    where a value is not finite."""
    layout = Layout.of(tensors)
    if flat is None:
        flat = torch.cat([t.detach().reshape(-1) for _, t in tensors])
    dev = flat.device
    lengths = _lengths(layout.numels, str(dev))
    top = torch.segment_reduce(flat.abs(), "max", lengths=lengths)  # NaN where a NaN is
    finite_and_top = to_host(torch.cat([torch.isfinite(flat).all().to(top.dtype).reshape(1), top]))
    if finite_and_top[0] != 1.0:
        return None
    with host_side():
        scales = np.array([scale_for(float(v), codec.s) for v in finite_and_top[1:]], dtype=np.float32)
    m = to_device(scales, dev)
    # Division by each value's own scale (never a multiplication by 1 / m: the per-tensor bytes);
    # a tensor whose scale is 0 is all zeros: divided by 1 instead, every q is 0.
    spread = torch.where(m > 0, m, torch.ones_like(m)).repeat_interleave(lengths, output_size=layout.total)
    q = torch.div(flat, spread).round_().add_(0.0)  # -0.0 -> +0.0, as the per-tensor path
    recon = None
    if want_recon:
        recon = q * m.repeat_interleave(lengths, output_size=layout.total)
    plan = _groups(layout.numels, layout.offsets, str(dev))
    packed = torch.zeros(plan.first.shape[0], dtype=torch.float32, device=dev)
    for k, w in enumerate(WEIGHTS):
        at = plan.first + plan.step * k
        inside = at < plan.end
        digit = q[torch.where(inside, at, 0)].add_(1.0).mul_(inside)  # the padding digit is 0
        packed.add_(digit, alpha=w)
    data = to_host(packed.to(torch.uint8))
    del q, spread, packed
    with host_side():
        encoded = []
        start = 0
        for (name, t), n, scale in zip(tensors, layout.numels, scales, strict=True):
            g = groups(n)
            group_bytes = data[start : start + g]
            start += g
            body = _zero_run_encode_np(group_bytes) if codec.zero_run else group_bytes
            payload = ThreeLCPayload(scale=float(scale), numel=n, zero_run=codec.zero_run, data=body.tobytes())
            encoded.append(codec._envelope(t, name, payload))
    return encoded, recon


@lru_cache(maxsize=8)
def _lengths(numels: tuple[int, ...], device: str) -> torch.Tensor:
    return to_device(np.array(numels, dtype=np.int64), torch.device(device))


def literals_of(
    codec: ThreeLC, payload: Payload, spec: TensorSpec, offset: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """One tensor's part of :func:`decode_into`, on the host: ``(where, bytes, scale)`` of its
    groups other than 121 (``where``: the flat positions of each group's part-0 digit, its
    ``G``, and its tensor's end, as three rows), after every check of :meth:`ThreeLC.decode`
    but the envelope's. None where the scale is beyond float32 (the dense path handles it)."""
    pos, vals, scale = codec.literals(payload, spec)
    with np.errstate(over="ignore"):
        s32 = np.float32(scale)
    if not np.isfinite(s32):
        return None
    n = spec.numel
    where = np.empty((3, pos.shape[0]), dtype=np.int64)
    where[0] = pos + offset
    where[1] = groups(n)
    where[2] = offset + n
    return where, vals, np.full(pos.shape[0], s32, dtype=np.float32)


def decode_into(flat: torch.Tensor, literals: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """Write every tensor's decoded values into ``flat`` (zeros at the tensors' places, one spare
    value at the end): the groups of ``literals`` (:func:`literals_of`), digit by digit."""
    if not literals:
        return
    dev = flat.device
    where = to_device(np.concatenate([w for w, _, _ in literals], axis=1), dev)
    rest = to_device(np.concatenate([b for _, b, _ in literals]), dev).to(torch.int64)
    scale = to_device(np.concatenate([s for _, _, s in literals]), dev)
    first, step, end = where.unbind(0)
    spare = flat.shape[0] - 1
    for k in range(4, -1, -1):
        digit = rest % 3
        rest = rest.div_(3, rounding_mode="floor")
        at = first + step * k
        value = digit.to(torch.float32).sub_(1.0).mul_(scale)  # -1, 0 or 1 times the scale
        flat.index_put_((torch.where(at < end, at, spare),), value)
