"""All-dense updates on a GPU in one copy each way per wire dtype (issue #13: dense paths as fast
as a cast and a copy, on every device).

On the CPU an update whose every tensor has a plain dense codec (``dense-fp16``, ``dense-fp32``,
``identity``) is written and read by one call of the wire kernel
(:class:`fedcomp.wire.serde.DenseFrames`). From or onto another device the per-tensor path casts,
copies and waits once per tensor: on an H200, 52-60 ms to decode a ResNet-50 update (161 tensors),
45-49x a device ``copy_`` of it. Here the values cross once per wire dtype (usually two: the large
tensors' codec and the small ones' ``dense-fp32``), cast on the device, so a float16 update moves
half the bytes, and the same wire kernel frames them on the host:

- :func:`write_on_device`: each wire dtype's tensors concatenated and cast on the device, one copy
  to the host, the frames written from those values (a plain copy in the kernel, CRC in the same
  pass).
- :func:`read_on_device`: the frames read into one host buffer per wire dtype (copied, the CRC
  checked), one copy to the device each, cast there into one float32 buffer; the tensors returned
  are views of it, or the receiver's ``out`` buffers, written by one fused copy.

The values are the device's casts, as on the per-tensor path from that device (round to nearest
even, as on the CPU; a NaN's payload bits may differ from the CPU's, as they already differ
between torch's and F16C's casts). Only float32 tensors and specs, float16 / float32 wire dtypes;
anything else returns None and the caller takes the general path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fedcomp.codecs.base import TensorSpec
from fedcomp.codecs.flat import to_device, to_host
from fedcomp.methods.flat_update import buffers_fit
from fedcomp.wire.payloads import TORCH_DTYPES, EncodedUpdate
from fedcomp.wire.serde import DenseFrames

#: The wire dtypes these paths move (bfloat16 has no NumPy dtype to cross the host in).
_WIRE = ("float16", "float32")


def _by_wire_dtype(frames: DenseFrames) -> dict[str, list[int]] | None:
    """The frames' indices by wire dtype, each in order; None where one is not in :data:`_WIRE`."""
    groups: dict[str, list[int]] = {}
    for i, enc in enumerate(frames.encodings):
        if enc not in _WIRE:
            return None
        groups.setdefault(enc, []).append(i)
    return groups


def _by_frame(
    groups: dict[str, list[int]], buffers: Mapping[str, torch.Tensor], sizes: Sequence[int]
) -> list[torch.Tensor]:
    """Each frame's view of its wire dtype's buffer (which holds that dtype's frames back to back),
    in the frames' order."""
    views: dict[int, torch.Tensor] = {}
    for enc, rows in groups.items():
        views.update(zip(rows, buffers[enc].split([sizes[i] for i in rows]), strict=True))
    return [views[i] for i in range(len(sizes))]


def write_on_device(frames: DenseFrames, base_model_version: int, sources: Sequence[torch.Tensor]) -> bytes | None:
    """:meth:`DenseFrames.write` of float32 ``sources`` on one device (any, the CPU included: what
    the tests compare): the same bytes, up to the device's cast. None where this is not that case
    (then nothing was written)."""
    groups = _by_wire_dtype(frames)
    if groups is None or len(sources) != len(frames.encodings) or not sources:
        return None
    device = sources[0].device
    if any(s.device != device or s.dtype != torch.float32 for s in sources):
        return None
    on_host = {}
    for enc, rows in groups.items():
        flat = torch.cat([sources[i].detach().reshape(-1) for i in rows]).to(TORCH_DTYPES[enc])
        on_host[enc] = torch.from_numpy(to_host(flat))
    return frames.write(base_model_version, _by_frame(groups, on_host, [s.numel() for s in sources]))


def read_on_device(
    frames: DenseFrames,
    data: bytes | bytearray | memoryview,
    specs: Sequence[TensorSpec],
    device: torch.device,
    out: Mapping[str, torch.Tensor] | None = None,
) -> tuple[EncodedUpdate, dict[str, torch.Tensor]] | None:
    """:func:`fedcomp.methods.update.decode_update_bytes` by ``frames`` onto ``device``: the parsed
    update and the tensors (new views of one buffer, or ``out``'s buffers, each of its spec's
    shape, float32, contiguous, on ``device``). None, with nothing written, where ``data`` is not
    an update these frames describe or this is not the case above (then the general path runs and
    words any error). Raises :class:`PayloadError` when the CRC-32 does not match: nothing on the
    device is written then."""
    groups = _by_wire_dtype(frames)
    if groups is None or len(specs) != len(frames.encodings) or not specs:
        return None
    if any(spec.dtype != torch.float32 for spec in specs):
        return None
    if out is not None and not buffers_fit(out, specs, device):
        return None
    sizes = [spec.numel for spec in specs]
    staged = {enc: torch.empty(sum(sizes[i] for i in rows), dtype=TORCH_DTYPES[enc]) for enc, rows in groups.items()}
    base = frames.read(data, _by_frame(groups, staged, sizes))
    if base is None:
        return None
    flat = torch.empty(sum(sizes), dtype=torch.float32, device=device)
    parts, at = {}, 0
    for enc, buf in staged.items():
        parts[enc] = part = flat[at : at + buf.numel()]
        if enc == "float32":
            to_device(buf.numpy(), device, into=part)
        else:
            part.copy_(to_device(buf.numpy(), device))  # the cast, on the device
        at += buf.numel()
    decoded = [v.view(spec.shape) for v, spec in zip(_by_frame(groups, parts, sizes), specs, strict=True)]
    if out is not None:
        targets = [out[spec.name] for spec in specs]
        torch._foreach_copy_(targets, decoded)
        decoded = targets
    return frames.update(data, base), {spec.name: t for spec, t in zip(specs, decoded, strict=True)}
