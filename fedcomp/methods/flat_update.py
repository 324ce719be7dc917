"""Whole updates on a device other than the CPU, in a number of kernel launches, syncs and copies
that does not grow with the number of tensors (issue #13's whole-update engine).

:class:`fedcomp.methods.update.UpdateEncoder` and :func:`fedcomp.methods.update.decode_update`
hand their work here when the tensors (or the decoded ones) live on a CUDA device and the case
is one this module covers; everything else keeps the per-tensor path, whose bytes these equal
(tested on CPU, where the same torch operators run):

- **Encode** (:func:`encode_on_device`): the SBC or 3LC tensors in one call
  (:func:`fedcomp.codecs.sbc_device.encode_update`, :func:`fedcomp.codecs.threelc_device.encode_update`),
  their error-feedback residuals kept as one flat float32 buffer on the device
  (:meth:`ErrorFeedback.flat_residual`: the accumulator is one ``cat`` and one ``add_``; the new
  residual is the accumulator less the reconstruction: for SBC the mean at the kept positions, one
  ``index_put_``); the small tensors, which go dense, to the host in a copy of their own that
  does not wait (:func:`fedcomp.codecs.flat.to_host_later`), coded there while the device works on
  the large ones (the engines' ``meanwhile``).
- **Decode** (:func:`decode_on_device`): every payload is checked and decoded on the host (the CPU
  kernels: every SBC position stream in one call, every 3LC stream in one more, the plain dense
  values read from the received bytes, so that the host's share does not grow by a Python call
  and a tensor per tensor); everything the device needs (the SBC positions, int32 where the
  update's fit, and values, the 3LC groups other than 121, the other tensors' values) in one copy
  to it (:func:`fedcomp.codecs.flat.to_device_many`); there one buffer of zeros, the SBC
  positions written by one ``index_put_``, the 3LC groups by five scatters, every other tensor's
  values by one more ``index_put_``. The tensors returned are views of that buffer (or the
  receiver's buffers, written by one copy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import cast

import numpy as np
import torch

from fedcomp.codecs import threelc_device
from fedcomp.codecs.base import Codec, TensorSpec
from fedcomp.codecs.dense import DenseFP16, DenseFP32, Identity, _DenseCodec
from fedcomp.codecs.flat import (
    Layout,
    concrete_device,
    host_side,
    position_dtype,
    to_device,
    to_device_many,
    to_host,
    to_host_later,
)
from fedcomp.codecs.sbc import SBC
from fedcomp.codecs.sbc_device import encode_update
from fedcomp.codecs.scatter_sum import FlatPositions, ScatterSum
from fedcomp.codecs.scatter_sum import available as scatter_sum_available
from fedcomp.codecs.threelc import ThreeLC
from fedcomp.errors import PayloadError, shown
from fedcomp.methods.feedback import ErrorFeedback
from fedcomp.methods.statistics import sent_dense
from fedcomp.wire.fast_writer import DeferredDensePayload
from fedcomp.wire.payloads import TORCH_DTYPES, DensePayload, EncodedTensor, EncodedUpdate


def _one_device(tensors: Iterable[torch.Tensor]) -> torch.device | None:
    """The one non-CPU device every tensor is on, else None."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return None
    (device,) = devices
    return None if device.type == "cpu" else device


def encode_on_device(
    tensors: Mapping[str, torch.Tensor],
    codec: Codec,
    small_codec: Codec,
    min_numel: int,
    feedback: ErrorFeedback | None,
    base_model_version: int,
    *,
    keep_sent: bool = False,
    device: torch.device | None = None,
) -> tuple[EncodedUpdate, dict[str, torch.Tensor] | None] | None:
    """:meth:`UpdateEncoder.encode` (no per-tensor codecs) of ``tensors`` on one non-CPU device
    with an SBC, 3LC or plain dense ``codec``, and with ``keep_sent`` what the receiver decodes of
    it (float32, on the device: :attr:`UpdateEncoder.sent`), or None where this is not that case
    (then the per-tensor path runs): the same bytes, residuals and reconstructions. ``device``: run
    on that device even when it is the CPU (what the tests do to compare with the per-tensor path)."""
    if not tensors or not isinstance(codec, SBC | ThreeLC | DenseFP16 | DenseFP32 | Identity):
        return None
    if isinstance(codec, _DenseCodec) and type(codec) not in (DenseFP16, DenseFP32, Identity):
        return None  # (a subclass may code otherwise)
    dev = concrete_device(device) if device is not None else _one_device(tensors.values())
    if dev is None or any(t.device != dev for t in tensors.values()):
        return None
    if feedback is not None and feedback.stale is not None and feedback.stale.active:
        return None
    large: list[tuple[str, torch.Tensor]] = []
    small: list[tuple[str, torch.Tensor]] = []
    for name, t in tensors.items():
        if not sent_dense(name, t.numel(), min_numel):
            large.append((name, t))
        elif feedback is not None and feedback.residual(name) is not None:
            return None  # a small tensor with a residual goes through the error feedback dense
        else:
            small.append((name, t))
    if any(t.dtype != torch.float32 or t.numel() == 0 for _, t in large):
        return None
    if any(t.dtype not in _EXACT_IN_FLOAT32 for _, t in small):  # (they travel as float32)
        return None
    done: dict[str, EncodedTensor] = {}
    sent: dict[str, torch.Tensor] = {}
    # The large tensors' values and the small ones' laid out by one copy (each launch is tens of
    # microseconds of a GPU host's time), the large ones first; the small ones' then on their way to
    # the host at once, so that the host codes them while the device works on the large ones.
    n_large = sum(t.numel() for _, t in large)
    both = _laid_out([t for _, t in large + small], dev)
    small_copy = to_host_later(both[n_large:]) if small else None
    small_left = small_copy is not None

    def code_small() -> None:
        nonlocal small_left
        assert small_copy is not None
        _encode_small(small, small_codec, keep_sent, dev, done, sent, small_copy.wait())
        small_left = False

    if large:
        layout = Layout.of(large)
        acc = both[:n_large]
        residual = feedback.flat_residual(layout, dev) if feedback is not None else None
        if residual is not None:
            acc.add_(residual)
        # (with keep_sent the small tensors' reconstructions go back to the device in a copy from
        # ordinary memory, which waits for the device: after the large ones)
        meanwhile = code_small if small_left and not keep_sent else None
        coded = _encode_large(codec, large, layout, acc, feedback, keep_sent, meanwhile)
        if coded is None:
            return None  # a value that is not finite: the per-tensor path says which
        encoded, recon = coded
        if keep_sent:
            assert recon is not None
            sent.update(layout.views(recon))
        done.update(zip(layout.names, encoded, strict=True))
    if small_left:
        code_small()
    update = EncodedUpdate(base_model_version=base_model_version, tensors=tuple(done[name] for name in tensors))
    return update, ({name: sent[name] for name in tensors} if keep_sent else None)


def _laid_out(tensors: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """The tensors' values back to back in a new float32 buffer on ``dev``, by one multi-tensor
    copy (on an H200, ``torch.cat`` of a ResNet-50 update's 161 tensors kept the GPU 0.42 ms, a
    quarter of its copy speed) into views of the buffer shaped as the tensors, made in C++
    (``unflatten_dense_tensors``: a view and a reshape per tensor in Python took a third of this
    function's time on the build machine's CPU, 0.37 -> 0.25 ms for ResNet-50's 161 tensors)."""
    with torch.no_grad():
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32, device=dev)
        torch._foreach_copy_(torch._C._nn.unflatten_dense_tensors(flat, tensors), tensors)
    return flat


def _encode_small(
    small: list[tuple[str, torch.Tensor]],
    small_codec: Codec,
    keep_sent: bool,
    dev: torch.device,
    done: dict[str, EncodedTensor],
    sent: dict[str, torch.Tensor],
    values: np.ndarray,
) -> None:
    """The tensors below ``min_numel`` through ``small_codec`` into ``done`` (and, with
    ``keep_sent``, their reconstructions on ``dev`` into ``sent``): their ``values`` (float32, back
    to back) on the host from one copy, also where ``dev`` is the CPU (``tensors_on_host`` would
    copy nothing there: the operators a GPU runs, so that counting them on the CPU is faithful);
    reconstructions back in one more."""
    layout = Layout.of(small)
    flat_host = torch.from_numpy(values)
    with host_side():
        if (
            not keep_sent
            and type(small_codec) in (DenseFP32, Identity)
            and all(t.dtype == torch.float32 for _, t in small)
        ):
            # What their ``encode`` makes of a float32 tensor (float32 values, deferred), without
            # a view, a check and an envelope read from each: the values referenced from the copy.
            payloads = DeferredDensePayload.of_parts("float32", flat_host, layout.numels)
            done.update(
                zip(layout.names, small_codec._float32_envelopes(layout.names, layout.shapes, payloads), strict=True)
            )
            return
        host = layout.views(flat_host)
        recons = []
        for name, t in small:
            on_host = host[name].to(t.dtype)
            if keep_sent:
                done[name], r = small_codec.encode_with_reconstruction(on_host, name)
                recons.append(r.reshape(-1).to(torch.float32).numpy())
            else:
                done[name] = small_codec.encode(on_host, name)
    if keep_sent:
        sent.update(layout.views(to_device(np.concatenate(recons), dev)))


#: The dtypes whose every value float32 holds exactly.
_EXACT_IN_FLOAT32 = (torch.float32, torch.float16, torch.bfloat16)


def _encode_large(
    codec: SBC | ThreeLC | _DenseCodec,
    large: list[tuple[str, torch.Tensor]],
    layout: Layout,
    acc: torch.Tensor,
    feedback: ErrorFeedback | None,
    keep_sent: bool,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[list[EncodedTensor], torch.Tensor | None] | None:
    """The compressed part of :func:`encode_on_device`: the tensors encoded and, with
    ``keep_sent``, the reconstruction (flat); the residual taken off ``acc`` and kept. None where a
    value is not finite. ``meanwhile``: host work the SBC and 3LC engines do while the device
    works (a dense codec's encode leaves it to the caller)."""
    want_recon = feedback is not None or keep_sent
    if isinstance(codec, _DenseCodec):
        return _encode_dense(codec, large, layout, acc, feedback, want_recon)
    if isinstance(codec, ThreeLC):
        coded = threelc_device.encode_update(
            codec, large, flat=acc, want_recon=want_recon, layout=layout, meanwhile=meanwhile
        )
        if coded is None:
            return None
        encoded, recon = coded
        if feedback is not None:
            assert recon is not None
            feedback.keep_flat(layout, acc.sub_(recon))
        return encoded, recon
    found = encode_update(codec, large, flat=acc, layout=layout, meanwhile=meanwhile)
    if found is None:
        return None
    recon = None
    if want_recon:  # SBC's reconstruction is sparse: one value at the kept positions
        # (one copy; the positions int32 where the update's fit: half the bytes)
        kept_on, value = to_device_many([([found.kept], found.kept.dtype), ([found.value], np.float32)], acc.device)
        assert kept_on is not None and value is not None  # (a tensor of at least one value keeps one)
        kept = kept_on.long()
        if keep_sent:
            recon = torch.zeros(layout.total, dtype=torch.float32, device=acc.device)
            recon.index_put_((kept,), value)
        if feedback is not None:  # acc - reconstruction, at the only positions where it is not 0
            acc.index_put_((kept,), value.neg_(), accumulate=True)
            feedback.keep_flat(layout, acc)
    return found.encoded, recon


def _encode_dense(
    codec: _DenseCodec,
    large: list[tuple[str, torch.Tensor]],
    layout: Layout,
    acc: torch.Tensor,
    feedback: ErrorFeedback | None,
    want_recon: bool,
) -> tuple[list[EncodedTensor], torch.Tensor | None]:
    """:func:`_encode_large` for a plain dense codec: the values cast to the wire dtype on the
    device and copied to the host once; each tensor's payload a view of that copy, written into
    the update's bytes by the wire kernel (:class:`DeferredDensePayload`: a copy there, no cast).
    The reconstruction is the cast back; the residual, the accumulator less it (float32 to
    float32: zeros), as :meth:`ErrorFeedback.encode_with_reconstruction` keeps per tensor."""
    encoding = codec._wire or "float32"  # (the tensors are float32)
    wire = acc.to(TORCH_DTYPES[encoding])
    host = torch.from_numpy(to_host(wire))
    encoded = codec._float32_envelopes(
        layout.names, layout.shapes, DeferredDensePayload.of_parts(encoding, host, layout.numels)
    )
    recon = None
    if want_recon:
        if wire is acc:  # float32 on the wire: the receiver decodes the accumulator itself
            recon = acc
            if feedback is not None:  # acc - recon: zeros (NaN where acc is not finite), as per tensor
                feedback.keep_flat(layout, acc - acc)
        else:
            recon = wire.to(torch.float32)
            if feedback is not None:
                feedback.keep_flat(layout, acc.sub_(recon))
    return encoded, recon


def decode_on_device(
    update: EncodedUpdate,
    specs: Sequence[TensorSpec],
    codecs: Iterable[Codec],
    device: torch.device,
    out: Mapping[str, torch.Tensor] | None = None,
    per_tensor: Mapping[str, Codec] | None = None,
) -> dict[str, torch.Tensor] | None:
    """:func:`decode_update` onto ``device``: the same checks, errors and values; the tensors are
    views of one buffer, or, with ``out`` (a buffer for every tensor, on ``device``), those
    buffers, written by one copy (one fused copy when they are not one buffer). None where a spec
    is not float32 or has no values, or ``out`` does not fit (then the per-tensor path runs)."""
    if not specs or any(spec.dtype != torch.float32 or spec.numel == 0 for spec in specs):
        return None
    device = concrete_device(device)
    if out is not None and not buffers_fit(out, specs, device):
        return None
    targets = [out[spec.name] for spec in specs] if out is not None else None
    region = _one_region(targets) if targets is not None else None
    layout, flat = _decode_flat(update, specs, codecs, device, per_tensor or {}, into=region)
    if targets is None:
        return layout.views(flat)
    if region is None:
        torch._foreach_copy_(targets, list(layout.views(flat).values()))
    return {spec.name: t for spec, t in zip(specs, targets, strict=True)}


def buffers_fit(out: Mapping[str, torch.Tensor], specs: Sequence[TensorSpec], device: torch.device) -> bool:
    """Whether ``out`` holds a buffer for every spec: its shape and dtype, contiguous, on ``device``."""
    return all(
        (t := out.get(spec.name)) is not None
        and tuple(t.shape) == tuple(spec.shape)
        and t.dtype == spec.dtype
        and t.is_contiguous()
        and t.device == device
        for spec in specs
    )


def _one_region(targets: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one flat buffer ``targets`` are back to back in, in order, or None."""
    first = targets[0]
    storage = first.untyped_storage()
    at = first.storage_offset()
    for t in targets:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != at:
            return None
        at += t.numel()
    return first.new_empty(0).set_(storage, first.storage_offset(), (at - first.storage_offset(),), (1,))


def _decode_flat(
    update: EncodedUpdate,
    specs: Sequence[TensorSpec],
    codecs: Iterable[Codec],
    device: torch.device,
    per_tensor: Mapping[str, Codec],
    into: torch.Tensor | None = None,
) -> tuple[Layout, torch.Tensor]:
    """The decoded tensors back to back in one buffer on ``device``, and their layout: ``into``
    (flat, float32, the tensors' size) where given, written only once every payload has passed
    its checks, else a new one."""
    accepted = {c.codec_id: c for c in codecs}
    if len(update.tensors) != len(specs):
        raise PayloadError("", f"update has {len(update.tensors)} tensors, expected {len(specs)}")
    layout = Layout.of_shapes([s.name for s in specs], [s.shape for s in specs])
    found = _Decoded()
    with host_side():
        _decode_on_host(update, specs, accepted, per_tensor, layout, found)
    if len(found.dense_rows) == len(specs):
        return layout, to_device(np.concatenate(found.dense), device, into=into)
    flat = torch.zeros(layout.total, dtype=torch.float32, device=device) if into is None else into.zero_()
    # Everything the device needs in one copy, the positions four bytes each where the update's
    # fit in int32 (on a GPU each copy from pageable memory is a wait of its own; the SBC
    # positions were two thirds of an update's bytes to copy, as int64).
    where = position_dtype(layout.total)
    kept, values, dense, streams, table, scales = to_device_many(
        [
            (found.kept, where),
            (found.values, np.float32),
            (found.dense, np.float32),
            *threelc_device.stream_groups(found.streams),
        ],
        device,
    )
    if kept is not None and values is not None:
        flat.index_put_((kept.long(),), values)
    if dense is not None:
        at = _dense_positions(layout.offsets, layout.numels, tuple(found.dense_rows), str(device))
        flat.index_put_((at,), dense)
    if streams is not None and table is not None and scales is not None:
        threelc_device.decode_on_device(flat, streams, table, scales)
    return layout, flat


@dataclass
class _Decoded:
    """What the host made of an update for :func:`decode_on_device`."""

    kept: list[np.ndarray] = field(default_factory=list)  # SBC: flat positions
    values: list[np.ndarray] = field(default_factory=list)  # SBC: the value at each
    streams: threelc_device.Streams | None = None  # 3LC
    dense: list[np.ndarray] = field(default_factory=list)  # any other codec: the values
    dense_rows: list[int] = field(default_factory=list)  # ... of these tensors


def _decode_on_host(
    update: EncodedUpdate,
    specs: Sequence[TensorSpec],
    accepted: dict[str, Codec],
    per_tensor: Mapping[str, Codec],
    layout: Layout,
    found: _Decoded,
) -> None:
    """Check and decode every tensor on the host, in order (the first error is raised): an SBC
    tensor to its positions and value, a 3LC tensor's stream checked (the device expands it), any
    other to its values. With the C kernels, the SBC tensors' position streams are decoded by one
    call for all of them (:class:`ScatterSum`), the 3LC streams checked by one more
    (:class:`threelc_device.StreamBatch`), and a plain dense tensor's values read straight from
    the received bytes: per tensor, only the checks that need no decoding run in Python."""
    batches = _Batches(
        ScatterSum() if scatter_sum_available() else None,
        threelc_device.StreamBatch(),
        position_dtype(layout.total),
    )
    kinds: dict[int, type] = {}  # each codec's kind by its id (an ABC's isinstance costs ~0.4 us)
    try:
        for row, (spec, enc) in enumerate(zip(specs, update.tensors, strict=True)):
            if enc.name != spec.name:
                raise PayloadError(spec.name, f"found tensor {shown(enc.name)} in its place")
            codec = per_tensor.get(spec.name) or accepted.get(enc.codec_id)
            if codec is None:
                raise PayloadError(spec.name, f"codec {enc.codec_id!r} is not accepted here ({sorted(accepted)})")
            kind = kinds.get(id(codec))
            if kind is None:
                kind = kinds[id(codec)] = next((k for k in (SBC, ThreeLC, _DenseCodec) if isinstance(codec, k)), Codec)
            if kind is SBC:
                codec = cast(SBC, codec)  # (no isinstance per tensor: ``kind`` said so)
                codec.check_envelope(enc, spec)
                if batches.sbc is not None:
                    nnz, b, bits, mean = codec.checked_positions(enc.payload, spec)
                    if nnz:
                        batches.sbc.positions(spec.name, bits, nnz, b, spec.numel, mean)
                        batches.sbc_bases.append(layout.offsets[row])
                        batches.rows[spec.name] = row
                    continue
                idx, mean = codec.positions(enc.payload, spec, torch.device("cpu"))
                found.kept.append(idx.numpy() + layout.offsets[row])
                found.values.append(np.full(idx.shape[0], mean, dtype=np.float32))
                continue
            if kind is ThreeLC:
                codec = cast(ThreeLC, codec)
                codec.check_envelope(enc, spec)
                if batches.threelc.add(codec, enc.payload, spec, layout.offsets[row]):
                    batches.rows[spec.name] = row
                    continue
            found.dense_rows.append(row)
            values = _dense_values(cast(_DenseCodec, codec), enc, spec) if kind is _DenseCodec else None
            if values is None:
                values = codec.decode(enc, spec, "cpu").reshape(-1).numpy()
            found.dense.append(values)
    except PayloadError as exc:
        batches.finish(found, (row, exc))
        raise
    batches.finish(found, None)


@dataclass
class _Batches:
    """The tensors :func:`_decode_on_host` decodes together once every tensor is checked."""

    sbc: ScatterSum | None
    threelc: threelc_device.StreamBatch
    where: type[np.int32] | type[np.int64]  # the flat positions' dtype
    sbc_bases: list[int] = field(default_factory=list)  # where each SBC tensor starts
    rows: dict[str, int] = field(default_factory=dict)  # the row of each tensor in a batch

    def finish(self, found: _Decoded, failed: tuple[int, PayloadError] | None) -> None:
        """Decode the batches into ``found``; raise the error of the first tensor in the update's
        order that has one: a batch's, or ``failed`` (the row where the checks stopped and their
        error), since the streams before that row are decoded only now."""
        errors = [] if failed is None else [failed]
        if self.sbc is not None and self.sbc_bases:
            flat = FlatPositions(self.sbc_bases, self.where)
            try:
                self.sbc.check(flat=flat)
            except PayloadError as exc:
                errors.append((self.rows[exc.tensor], exc))
            else:
                assert flat.kept is not None and flat.values is not None
                found.kept.append(flat.kept)
                found.values.append(flat.values)
        if len(self.threelc):
            try:
                found.streams = self.threelc.streams()
            except PayloadError as exc:
                errors.append((self.rows[exc.tensor], exc))
        if errors:
            raise min(errors, key=lambda e: e[0])[1]


def _dense_values(codec: _DenseCodec, enc: EncodedTensor, spec: TensorSpec) -> np.ndarray | None:
    """A plain dense codec's float32 values of ``enc``, read from the received bytes after the
    codec's own checks (what its ``decode`` does, without a torch tensor per tensor), or None
    where its decoder must run: a wire encoding other than float32 (a cast: torch's, which makes
    every float16 NaN one NaN where NumPy keeps its payload bits)."""
    payload = enc.payload
    if not isinstance(payload, DensePayload) or payload.encoding != "float32":
        return None  # (the decoder runs every check, once)
    codec.check_envelope(enc, spec)
    return np.frombuffer(codec.checked_payload(payload, spec).data, dtype="<f4")


@lru_cache(maxsize=8)
def _dense_positions(
    offsets: tuple[int, ...], numels: tuple[int, ...], rows: tuple[int, ...], device: str
) -> torch.Tensor:
    """The flat positions of the tensors ``rows``, in order, on ``device`` (kept: a receiver
    decodes the same layout every round)."""
    where = np.concatenate([np.arange(offsets[r], offsets[r] + numels[r], dtype=np.int64) for r in rows])
    return to_device(where, torch.device(device))
