"""Whole-model updates: which codec each tensor gets, encoding with error feedback, and decoding
an untrusted update against the shapes the receiver knows.

Tensors with fewer than ``min_numel`` elements (biases, batch-norm parameters) go dense: as in
3LC, compressing them costs more time than the bytes it saves. So do a model's running statistics
(BatchNorm's ``running_var``, ...), whatever their size: :mod:`fedcomp.methods.statistics`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import torch

from fedcomp.codecs.base import Codec, TensorSpec, check_codec, check_wire_dtype
from fedcomp.codecs.dense import DenseFP16, DenseFP32, Identity
from fedcomp.codecs.flat import concrete_device
from fedcomp.codecs.sbc import run_jobs
from fedcomp.errors import PayloadError, shown
from fedcomp.methods.dense_device import read_on_device, write_on_device
from fedcomp.methods.feedback import ErrorFeedback
from fedcomp.methods.flat_update import decode_on_device, encode_on_device
from fedcomp.methods.sent import KeptValues, Sent, encode_kept
from fedcomp.methods.statistics import sent_dense
from fedcomp.wire.payloads import TORCH_DTYPES, DensePayload, EncodedTensor, EncodedUpdate
from fedcomp.wire.serde import DenseFrames, update_from_bytes_deferred, update_to_bytes

#: Default size below which a tensor is sent dense.
DEFAULT_MIN_NUMEL = 1000

#: A tensor's fixed cost in :func:`run_jobs`' scheduling, in elements' worth (Python per tensor).
_JOB_OVERHEAD = 50_000

#: Tensors below this many elements stay on the calling thread even with a ``tensor_parallel``
#: codec: their Python outweighs their kernels, and in a lane they only trade the GIL back and
#: forth with the large tensors' lane (measured on the ResNet-50 update, SBC p = 1 %, 2 threads:
#: encode and serialize 25.4 -> 20.3 ms, decode into buffers 15.0 -> 13.4 ms; any bound from 32k to
#: 300k elements gave about the same).
_LANE_MIN = 1 << 16

T = TypeVar("T")

#: The codecs whose updates :class:`DenseFrames` writes and reads in one kernel call: exactly
#: these classes (a subclass may code differently), whose payload is the values cast.
_PLAIN_DENSE = (DenseFP16, DenseFP32, Identity)


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The specs a receiver needs to decode an update of these tensors, in order."""
    return [TensorSpec.of(name, t) for name, t in tensors.items()]


class UpdateEncoder:
    """Encodes a dict of tensors into one :class:`EncodedUpdate`.

    With ``error_feedback`` the large tensors go through an :class:`ErrorFeedback` whose residuals
    persist across calls (``state_dict``/``load_state_dict``); unless ``keep_sent`` asks for the
    reconstructions, an SBC tensor's residual is updated at its kept positions only
    (:meth:`ErrorFeedback.encode_without_reconstruction`). Small tensors use ``small_codec``
    (lossless fp32 by default, so they need no residual).

    Tensors that a codec with an ``encode_many`` (SBC) encodes plainly (no error feedback, no
    ``keep_sent``) go to it together, in one call (:meth:`fedcomp.codecs.sbc.SBC.encode_many`:
    one C kernel call for the whole list); what it leaves, and every other tensor, is encoded as
    follows. On CPU, the tensors of a ``tensor_parallel`` codec (SBC) of at least ``_LANE_MIN``
    elements are encoded several at once on ``torch.get_num_threads()`` threads
    (:func:`fedcomp.codecs.sbc.run_jobs`), the others on the calling thread meanwhile. Either
    way the bytes, reconstructions and residuals are those of a loop (tested). With one torch
    thread (the reference app's setting) the kernel runs on that thread and the rest is a loop.

    On a GPU (every tensor on one CUDA device), an SBC or 3LC update without per-tensor
    ``codecs`` is encoded whole (:func:`fedcomp.methods.flat_update.encode_on_device`): a number
    of kernel launches, syncs and copies that does not grow with the number of tensors, the
    residuals kept as one flat buffer on the device; the same bytes, residuals and ``sent``.
    """

    def __init__(
        self,
        codec: Codec,
        *,
        min_numel: int = DEFAULT_MIN_NUMEL,
        small_codec: Codec | None = None,
        error_feedback: bool = True,
    ) -> None:
        check_codec("codec", codec)
        if small_codec is not None:
            check_codec("small_codec", small_codec)
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel: must be an integer >= 0, got {min_numel!r}")
        self.min_numel = min_numel
        self.small_codec = small_codec or DenseFP32()
        self._codec = codec
        self.feedback = ErrorFeedback(codec) if error_feedback else None
        #: What the receiver decodes of the last update encoded with ``keep_sent`` (else None):
        #: float32 tensors, and with ``sparse_sent`` :class:`KeptValues` where the codec said what
        #: it keeps.
        self.sent: dict[str, Sent] | None = None

    @property
    def codec(self) -> Codec:
        return self._codec

    def encode(
        self,
        tensors: Mapping[str, torch.Tensor],
        base_model_version: int = 0,
        codecs: Mapping[str, Codec] | None = None,
        *,
        keep_sent: bool = False,
        sparse_sent: bool = False,
    ) -> EncodedUpdate:
        """Encode ``tensors`` in order (a tensor a dense codec encodes is read when the update is
        serialised: change none in place before, or use :meth:`encode_to_bytes`, which does both).
        A tensor named in ``codecs`` uses that codec instead of
        the default, whatever its size, and goes through the error feedback when it is on (DEFT
        gives each client per-tensor ranges every round: :mod:`fedcomp.methods.deft`).

        A small tensor that has a residual (a lost update added back,
        :meth:`fedcomp.methods.base.UplinkMethod.client_recover`) goes through the error feedback
        too, so the residual is sent. With ``keep_sent``, :attr:`sent` holds afterwards what the
        receiver will decode, per tensor (the client keeps it until the server says whether the
        update was aggregated). With ``sparse_sent`` too, a tensor that SBC, STC or top-k encodes
        on the CPU is held there as :class:`KeptValues` (its positions and values), not as a dense
        tensor: the same encoding and residual without a tensor of its size filled and
        subtracted."""
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                check_wire_dtype(t, name)  # (its error names the type, and NumPy's way out)
        codecs = codecs or {}
        unknown = set(codecs) - set(tensors)
        if unknown:
            raise ValueError(f"codecs: no tensor named {sorted(unknown)!r} in the update")
        fb = self.feedback
        if not codecs:  # on a GPU: the whole update at once (fedcomp.methods.flat_update)
            whole = encode_on_device(
                tensors, self._codec, self.small_codec, self.min_numel, fb, base_model_version, keep_sent=keep_sent
            )
            if whole is not None:
                update, sent = whole
                self.sent = None if sent is None else dict(sent)
                return update
        jobs: list[Callable[[], tuple[EncodedTensor, Sent | None]]] = []
        chosen: list[Codec] = []
        numels = [t.numel() for t in tensors.values()]
        together: dict[Codec, list[int]] = {}  # plain encodes of a codec that does many at once
        for i, (name, t) in enumerate(tensors.items()):
            override = codecs.get(name)
            small = override is None and sent_dense(name, numels[i], self.min_numel)
            codec = override if override is not None else self.small_codec if small else self._codec
            chosen.append(codec)
            if fb is not None and (not small or fb.residual(name) is not None):
                step = (
                    (fb.encode_with_kept_values if sparse_sent else fb.encode_with_reconstruction)
                    if keep_sent
                    else fb.encode_without_reconstruction
                )
                jobs.append(functools.partial(step, t, name, codec))
            elif keep_sent:
                kept = _with_kept_values if sparse_sent else _with_reconstruction
                jobs.append(functools.partial(kept, codec, t, name))
            else:
                jobs.append(functools.partial(_without_reconstruction, codec, t, name))
                if hasattr(codec, "encode_many"):
                    together.setdefault(codec, []).append(i)
        items = list(tensors.items())
        for codec, where in together.items():
            if len(where) < 2:
                continue
            for i, enc in zip(where, codec.encode_many([items[i] for i in where]), strict=True):  # type: ignore[attr-defined]
                if enc is not None:  # (else its job encodes it: errors are the job's)
                    jobs[i] = functools.partial(_encoded, enc)
                    numels[i] = 0  # nothing left to run in a lane
        on_cpu = all(t.device.type == "cpu" for t in tensors.values())
        done = _run_tensor_jobs(jobs, numels, chosen, on_cpu)
        if keep_sent:
            self.sent = {
                name: recon if isinstance(recon, KeptValues) else recon.to(torch.float32)
                for name, (_, recon) in zip(tensors, done, strict=True)
                if recon is not None
            }
        else:
            self.sent = None
        return EncodedUpdate(base_model_version=base_model_version, tensors=tuple(enc for enc, _ in done))

    def encode_to_bytes(
        self,
        tensors: Mapping[str, torch.Tensor],
        base_model_version: int = 0,
        codecs: Mapping[str, Codec] | None = None,
        *,
        keep_sent: bool = False,
        sparse_sent: bool = False,
    ) -> bytes:
        """``update_to_bytes(self.encode(...))``: the same bytes, and :attr:`sent` the same.

        An update that every tensor sends through a plain dense codec (``dense-fp16``,
        ``dense-fp32``, ``identity``; no error feedback, no ``codecs``, no ``keep_sent``) is
        written, from the second such update of the same tensors on, by one call of the wire kernel
        (:class:`fedcomp.wire.serde.DenseFrames`): the values cast into the output and the CRC
        taken in the same pass, with no per-tensor objects (a cast's time, where the general path
        adds a few milliseconds of Python per hundred tensors). Tensors on one GPU get there in one
        copy per wire dtype, cast on the device (:func:`fedcomp.methods.dense_device.write_on_device`)."""
        plain = not codecs and not keep_sent and self.feedback is None
        key = self._frames_key(tensors) if plain else None
        frames = _WRITE_FRAMES.get(key) if key is not None else None
        if frames is not None:
            values = list(tensors.values())
            on_cpu = values[0].device.type == "cpu"
            data = (
                frames.write(base_model_version, values)
                if on_cpu
                else write_on_device(frames, base_model_version, values)
            )
            if data is not None:
                self.sent = None
                return data
        update = self.encode(tensors, base_model_version, codecs, keep_sent=keep_sent, sparse_sent=sparse_sent)
        data = update_to_bytes(update)
        if key is not None and all(isinstance(t.payload, DensePayload) for t in update.tensors):
            _remember(_WRITE_FRAMES, key, DenseFrames(update.tensors))
        return data

    def _frames_key(self, tensors: Mapping[str, torch.Tensor]) -> tuple | None:
        """What an update's frames depend on (the tensors' names, shapes and dtypes, and the
        codecs they get), or None when a codec is not a plain dense one or the tensors are not
        float32 tensors on one device (the frames write only those)."""
        codecs = (self._codec, self.small_codec)
        if not tensors or any(type(c) not in _PLAIN_DENSE for c in codecs):  # (these classes have no settings)
            return None
        device = next(iter(tensors.values())).device
        shapes = []
        for name, t in tensors.items():
            if t.dtype != torch.float32 or t.device != device:
                return None
            shapes.append((name, tuple(t.shape)))
        return (type(self._codec), type(self.small_codec), self.min_numel, tuple(shapes))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.feedback.state_dict() if self.feedback is not None else {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor], device: torch.device | str | None = None) -> None:
        if self.feedback is not None:
            self.feedback.load_state_dict(state, device)


def _without_reconstruction(codec: Codec, t: torch.Tensor, name: str) -> tuple[EncodedTensor, None]:
    return codec.encode(t, name), None


def _with_reconstruction(codec: Codec, t: torch.Tensor, name: str) -> tuple[EncodedTensor, Sent]:
    return codec.encode_with_reconstruction(t, name)


def _with_kept_values(codec: Codec, t: torch.Tensor, name: str) -> tuple[EncodedTensor, Sent]:
    """:func:`_with_reconstruction`, as :class:`KeptValues` where the codec says what it keeps
    (:func:`~fedcomp.methods.sent.encode_kept`)."""
    found = encode_kept(codec, t, name)
    return found if found is not None else codec.encode_with_reconstruction(t, name)


def _encoded(enc: EncodedTensor) -> tuple[EncodedTensor, None]:
    return enc, None


def _codec_list(codecs: Iterable[Codec]) -> list[Codec]:
    """``codecs`` as a list; TypeError naming the argument for one codec or anything not a codec
    (``codecs=SBC()`` said "'SBC' object is not iterable")."""
    if isinstance(codecs, Codec | str):
        raise TypeError(f"codecs: a list of the codecs accepted is needed (e.g. [SBC(), DenseFP32()]), got {codecs!r}")
    out = list(codecs)
    for c in out:
        if not isinstance(c, Codec):
            raise TypeError(f"codecs: {c!r} is not a Codec (e.g. SBC(), get_codec('sbc'))")
    return out


def decode_update(
    update: EncodedUpdate,
    specs: Sequence[TensorSpec],
    codecs: Iterable[Codec],
    device: torch.device | str | None = None,
    per_tensor: Mapping[str, Codec] | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Decode an untrusted update into exactly the tensors ``specs`` describes.

    ``out``: buffers to decode into, by tensor name (each of its spec's shape and dtype,
    contiguous; :meth:`Codec.decode_into`), e.g. a receiver's own tensors kept from round to
    round; the result then holds those tensors. Tensors it does not name are decoded fresh.

    ``codecs`` are the codecs the receiver accepts (matched by ``codec_id``); a tensor named in
    ``per_tensor`` is decoded by that codec instead (e.g. ``TopK(ranges=...)``, which also checks
    that a DEFT client kept to its allocation). Raises
    :class:`PayloadError` when a tensor is missing, repeated, unexpected, or uses a codec not
    accepted, or when any payload is malformed. Nothing is allocated beyond the specs' sizes.
    On CPU the large tensors of ``tensor_parallel`` codecs are decoded several at once (as
    :class:`UpdateEncoder` encodes them); every tensor is then decoded even when one fails, and
    the error raised is the first failing tensor's in order, as a loop's. Onto a GPU (with ``out``
    when it holds every tensor) the payloads are checked and decoded
    on the host and written to the device all at once
    (:func:`fedcomp.methods.flat_update.decode_on_device`; new tensors are views of one buffer);
    the errors are the loop's.
    """
    codecs = _codec_list(codecs)
    if device is not None and torch.device(device).type != "cpu":
        whole = decode_on_device(update, specs, codecs, torch.device(device), out, per_tensor)  # on a GPU: at once
        if whole is not None:
            return whole
    accepted = {c.codec_id: c for c in codecs}
    if len(update.tensors) != len(specs):
        raise PayloadError("", f"update has {len(update.tensors)} tensors, expected {len(specs)}")
    jobs, chosen = [], []
    names = sorted(accepted)
    for spec, enc in zip(specs, update.tensors, strict=True):
        buffer = None if out is None else out.get(spec.name)
        codec = (per_tensor or {}).get(spec.name) or accepted.get(enc.codec_id)
        jobs.append(functools.partial(_decode_one, enc, spec, codec, names, device, buffer))
        chosen.append(codec)
    on_cpu = device is None or torch.device(device).type == "cpu"
    done = _run_tensor_jobs(jobs, [spec.numel for spec in specs], chosen, on_cpu)
    return {spec.name: t for spec, t in zip(specs, done, strict=True)}


def _run_tensor_jobs(
    jobs: Sequence[Callable[[], T]], numels: Sequence[int], codecs: Sequence[Codec | None], on_cpu: bool
) -> list[T]:
    """``[job() for job in jobs]``, one job per tensor of ``numels`` elements coded by ``codecs``:
    on CPU the tensors of a ``tensor_parallel`` codec with at least ``_LANE_MIN`` elements run in
    :func:`run_jobs`' lanes, the others on the calling thread meanwhile (a codec of None, one the
    receiver does not accept, there too: its job raises). The results, and the error raised, are
    those of the loop."""
    here = [c is None or not c.tensor_parallel or n < _LANE_MIN for c, n in zip(codecs, numels, strict=True)]
    if not on_cpu or all(here):
        return [job() for job in jobs]
    return run_jobs(jobs, [n + _JOB_OVERHEAD for n in numels], here)


def _decode_one(
    enc: EncodedTensor,
    spec: TensorSpec,
    codec: Codec | None,
    accepted: list[str],
    device: torch.device | str | None,
    buffer: torch.Tensor | None,
) -> torch.Tensor:
    """One tensor of :func:`decode_update` with ``codec`` (None: not one the receiver accepts)."""
    if enc.name != spec.name:
        raise PayloadError(spec.name, f"found tensor {shown(enc.name)} in its place")
    if codec is None:
        raise PayloadError(spec.name, f"codec {enc.codec_id!r} is not accepted here ({accepted})")
    return codec.decode(enc, spec, device) if buffer is None else codec.decode_into(enc, spec, buffer)


def decode_update_bytes(
    data: bytes,
    specs: Sequence[TensorSpec],
    codecs: Iterable[Codec],
    device: torch.device | str | None = None,
    per_tensor: Mapping[str, Codec] | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> tuple[EncodedUpdate, dict[str, torch.Tensor]]:
    """Parse and decode untrusted update bytes: ``update_from_bytes(data, expected=specs)``, then
    :func:`decode_update`, with the CRC-32 of a large update computed on a worker thread while the
    tensors are decoded (:func:`fedcomp.wire.serde.update_from_bytes_deferred`) instead of before.
    Returns the parsed update (its ``base_model_version`` and payloads) and the tensors. Raises
    the same :class:`PayloadError` as the two calls in turn; on a checksum mismatch the checksum's,
    whatever else the corruption broke (``out`` may then have been written).

    An update whose every tensor has a plain dense codec (``dense-fp16``, ``dense-fp32``,
    ``identity``), decoded without ``per_tensor``, is read, from the second update of the same
    tensors and codecs on, by one call of the wire kernel (:class:`DenseFrames`: its framing
    compared byte for byte with the last accepted one's, the values cast into the outputs with the
    CRC taken in the same pass; onto a GPU into one host buffer per wire dtype, then one copy each
    and the cast on the device: :func:`fedcomp.methods.dense_device.read_on_device`); bytes that
    differ in anything but values and base version take the general path, which reports what is
    wrong."""
    codecs = _codec_list(codecs)
    key = _read_key(specs, codecs) if per_tensor is None else None
    frames = _READ_FRAMES.get(key) if key is not None else None
    if frames is not None:
        if device is None or torch.device(device).type == "cpu":
            done = _read_frames(frames, data, specs, out)
        else:
            done = read_on_device(frames, data, specs, concrete_device(device), out)
        if done is not None:
            return done
    update, verify = update_from_bytes_deferred(data, expected=specs)
    try:
        tensors = decode_update(update, specs, codecs, device, per_tensor, out)
    except PayloadError:
        verify()
        raise
    verify()
    if key is not None and _plain_dense(update, specs, codecs):
        _remember(_READ_FRAMES, key, DenseFrames(update.tensors))
    return update, tensors


#: The frames of the last all-dense updates :meth:`UpdateEncoder.encode_to_bytes` wrote (by the
#: tensors' names and shapes and the codecs) and :func:`decode_update_bytes` accepted (by the specs
#: and codecs): a sender or receiver codes the same model's updates every round, with encoders
#: made afresh each time; a process with several models or methods keeps a few.
_WRITE_FRAMES: dict[tuple, DenseFrames] = {}
_READ_FRAMES: dict[tuple, DenseFrames] = {}
_FRAMES_KEPT = 8


_FRAMES_LOCK = threading.Lock()


def _remember(cache: dict[tuple, DenseFrames], key: tuple, frames: DenseFrames) -> None:
    """Keep ``frames`` under ``key``, dropping the oldest entry past :data:`_FRAMES_KEPT`
    (under a lock: a server may decode replies on several threads; lookups need none)."""
    with _FRAMES_LOCK:
        cache.pop(key, None)
        while len(cache) >= _FRAMES_KEPT:
            cache.pop(next(iter(cache)))
        cache[key] = frames


def _read_key(specs: Sequence[TensorSpec], codecs: Sequence[Codec]) -> tuple:
    """What a receiver's frames depend on: the specs (names, shapes, dtypes) and the codecs."""
    return (
        tuple((s.name, tuple(s.shape), s.dtype) for s in specs),
        tuple((type(c), c.codec_id) for c in codecs),
    )


def _plain_dense(update: EncodedUpdate, specs: Sequence[TensorSpec], codecs: Sequence[Codec]) -> bool:
    """Whether every tensor of an accepted ``update`` has a dense payload decoded by a plain dense
    codec into float32 or its own wire dtype (what :meth:`DenseFrames.read` casts)."""
    by_id = {c.codec_id: c for c in codecs}
    for spec, t in zip(specs, update.tensors, strict=True):
        codec = by_id.get(t.codec_id)
        if type(codec) not in _PLAIN_DENSE or not isinstance(t.payload, DensePayload):
            return False
        if spec.dtype not in (torch.float32, TORCH_DTYPES[t.payload.encoding]):
            return False
    return True


def _read_frames(
    frames: DenseFrames, data: bytes, specs: Sequence[TensorSpec], out: Mapping[str, torch.Tensor] | None
) -> tuple[EncodedUpdate, dict[str, torch.Tensor]] | None:
    """:func:`decode_update_bytes` by ``frames`` (None: take the general path; nothing written)."""
    outs = []
    for spec in specs:
        buf = None if out is None else out.get(spec.name)
        if buf is None:
            buf = torch.empty(spec.shape, dtype=spec.dtype)
        elif tuple(buf.shape) != tuple(spec.shape) or buf.dtype != spec.dtype:
            return None  # the general path raises decode_into's error
        outs.append(buf)
    base = frames.read(data, outs)
    if base is None:
        return None
    return frames.update(data, base), {spec.name: t for spec, t in zip(specs, outs, strict=True)}
