"""Error feedback (residual accumulation): the memory half of GRACE's compressor/memory split.

SBC and 3LC are biased compressors: what one round drops must be sent later or training drifts.
``ErrorFeedback`` wraps any codec and keeps, per tensor name, what the decoded message lacked:
compensate (add the residual) -> compress -> update memory (residual = input - reconstruction).
Residuals live on the device of the tensors they belong to.

Stale residuals: with partial participation a client's residual waits for its next turn (about
10 rounds when 10 of 100 clients train per round) while the model moves on. :class:`StaleResidual`
optionally shrinks such a residual before it is added back: a decay ``gamma ** (age - 1)``
(``age`` = rounds since the client last sent, so a client that sends every round keeps its
residual whole) and/or a clip of its norm to ``clip`` times the fresh update's, per tensor. Both
depart from plain error feedback (Seide et al. 2014; SBC, 3LC): what they remove is never sent,
so ``sum(sent) + residual == sum(inputs)`` no longer holds. Off by default: see
docs/compression_gap.md for the measurement.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp.codecs.base import Codec, check_codec
from fedcomp.codecs.flat import Layout
from fedcomp.methods.sent import Sent, encode_kept
from fedcomp.wire.payloads import WIRE_DTYPES, EncodedTensor


@dataclass(frozen=True)
class StaleResidual:
    """How a residual that waited is shrunk before use; the defaults change nothing. Named after
    the run-config keys it is meant for, ``stale-residual-decay`` and ``stale-residual-clip``
    (examples/compression_gap.py reads them; the client mod does not yet)."""

    #: Factor per round of waiting beyond the first, in (0, 1]; 1 = no decay.
    decay: float = 1.0
    #: Largest ||residual|| as a multiple of ||fresh update||, per tensor; 0 = no clip.
    clip: float = 0.0

    def __post_init__(self) -> None:
        if not (0.0 < self.decay <= 1.0):
            raise ValueError(f"stale-residual-decay: {self.decay} is outside (0, 1]")
        if not (self.clip >= 0.0 and math.isfinite(self.clip)):
            raise ValueError(f"stale-residual-clip: {self.clip} is not a finite number >= 0")

    @property
    def active(self) -> bool:
        return self.decay < 1.0 or self.clip > 0.0

    def apply(self, residual: torch.Tensor, fresh: torch.Tensor, age: int) -> torch.Tensor:
        """``residual`` as it should be added to ``fresh`` after waiting ``age`` rounds (>= 1)."""
        if age < 1:
            raise ValueError(f"a residual's age is at least 1 round, got {age}")
        out = residual
        if self.decay < 1.0 and age > 1:
            out = out * self.decay ** (age - 1)
        if self.clip > 0.0:
            bound = self.clip * float(fresh.norm())
            norm = float(out.norm())
            if norm > bound:
                out = out * (bound / norm) if norm > 0 else out
        return out


class ErrorFeedback:
    """A stateful wrapper that gives any codec residual accumulation.

    ``encode`` has the codec's signature, so an ``ErrorFeedback`` can stand where a codec is
    used for encoding. ``codec`` may be swapped between rounds (e.g. a new sparsity p) without
    losing the residuals.
    """

    def __init__(self, codec: Codec, stale: StaleResidual | None = None) -> None:
        check_codec("codec", codec)
        self.codec = codec
        self._residuals: dict[str, torch.Tensor] = {}
        #: The buffer :meth:`keep_flat` kept last: its layout, itself, and the views handed out.
        self._flat: tuple[Layout, torch.Tensor, dict[str, torch.Tensor]] | None = None
        #: The stale-residual remedy (None: residuals are added back whole, the classic rule).
        self.stale = stale
        #: Rounds since this client last sent (set by the caller each round; 1 = every round).
        self.age = 1

    def encode(self, tensor: torch.Tensor, name: str, codec: Codec | None = None) -> EncodedTensor:
        """Compress ``tensor`` plus its residual with ``codec`` (default: ``self.codec``); the
        residual becomes what the message lacked. A per-call ``codec`` (e.g. DEFT's ranges for
        this round) shares the same residual: entries it does not send stay in it."""
        return self.encode_with_reconstruction(tensor, name, codec)[0]

    def encode_with_reconstruction(
        self, tensor: torch.Tensor, name: str, codec: Codec | None = None
    ) -> tuple[EncodedTensor, torch.Tensor]:
        """:meth:`encode`, also returning what the receiver will decode (float32)."""
        codec = self.codec if codec is None else codec
        acc, own = self._accumulate(tensor, name)
        return self._encode_dense(acc, own, name, codec, tensor.dtype)

    def encode_without_reconstruction(
        self, tensor: torch.Tensor, name: str, codec: Codec | None = None
    ) -> tuple[EncodedTensor, None]:
        """:meth:`encode` (as a pair, for :class:`fedcomp.methods.update.UpdateEncoder`'s jobs):
        the same encoding and residual as :meth:`encode_with_reconstruction`, bit for bit
        (tested), without its dense reconstruction where the codec can say what it keeps instead
        (``encode_sparse``: SBC's positions and the one value there, STC's and top-k's positions
        and values, on CPU). The residual is then the accumulator less those values at those
        positions, where ``acc - reconstruction`` would
        allocate, fill and subtract a tensor of each tensor's size (measured on the ResNet-50
        update with error feedback: about 5 % less time per update)."""
        return self._encode_sparse_first(tensor, name, codec)[0], None

    def encode_with_kept_values(
        self, tensor: torch.Tensor, name: str, codec: Codec | None = None
    ) -> tuple[EncodedTensor, Sent]:
        """:meth:`encode_without_reconstruction`, also returning what the receiver will decode:
        :class:`KeptValues` where the codec said what it keeps, else the dense reconstruction of
        :meth:`encode_with_reconstruction` (the same encoding and residual either way)."""
        enc, kept = self._encode_sparse_first(tensor, name, codec)
        assert kept is not None
        return enc, kept

    def _encode_sparse_first(
        self, tensor: torch.Tensor, name: str, codec: Codec | None
    ) -> tuple[EncodedTensor, Sent | None]:
        codec = self.codec if codec is None else codec
        acc, own = self._accumulate(tensor, name)
        # (float64 says a float32 accumulator exactly: the same encoding but for its dtype)
        exact = tensor.dtype in (torch.float32, torch.float64)
        found = encode_kept(codec, acc, name) if exact else None
        if found is None:
            return self._encode_dense(acc, own, name, codec, tensor.dtype)
        enc, kept = found
        if tensor.dtype != torch.float32:
            enc = dataclasses.replace(enc, dtype=WIRE_DTYPES[tensor.dtype])
        new = acc if own else acc.clone()  # (without a residual, acc is the caller's tensor)
        flat = new.numpy().reshape(-1)
        # acc - reconstruction: the reconstruction is 0 elsewhere (the positions are distinct)
        values = kept.values
        flat[kept.positions] -= values if isinstance(values, np.ndarray) else np.float32(values)
        self._residuals[name] = new
        return enc, kept

    def _accumulate(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, bool]:
        """``tensor`` plus its residual, float32, and whether that is a new tensor of this call's
        own (a residual was added; else it may be the caller's tensor itself)."""
        acc = tensor.detach().to(torch.float32)
        residual = self._residuals.get(name)
        if residual is None:
            return acc, False
        if residual.shape != acc.shape:
            raise ValueError(f"residual for {name!r} has shape {list(residual.shape)}, tensor has {list(acc.shape)}")
        residual = residual.to(acc.device)
        if self.stale is not None and self.stale.active:
            residual = self.stale.apply(residual, acc, self.age)
        # A new tensor either way (addition commutes: the same bits); on CPU in NumPy, whose
        # kernels run on the calling thread (torch's stall on a busy machine). (NumPy adds two 0-d
        # arrays into a scalar, which torch.from_numpy refuses: asarray makes it an array again.)
        if _cpu_f32(residual, acc):
            return torch.from_numpy(np.asarray(np.add(residual.numpy(), acc.numpy()))), True
        return acc + residual, True

    def _encode_dense(
        self, acc: torch.Tensor, own: bool, name: str, codec: Codec, dtype: torch.dtype
    ) -> tuple[EncodedTensor, torch.Tensor]:
        """Encode ``acc`` and keep ``acc - reconstruction`` as the residual (in place when ``acc``
        is this call's ``own``).

        The codec sees ``acc`` in the input's float ``dtype``, so the message says that dtype (a
        float16 model's update decodes with the model's own specs, :func:`specs_of`, as it does
        without error feedback) and the residual, kept in float32, also holds what the cast lost."""
        cast = dtype != torch.float32 and dtype.is_floating_point  # (integers travel as float32)
        enc, recon = codec.encode_with_reconstruction(acc.to(dtype) if cast else acc, name)
        recon = recon.to(dtype).to(torch.float32) if cast else recon.to(torch.float32)  # (as decoded)
        if own and _cpu_f32(acc, recon) and not _same_storage(acc, recon):
            # The accumulator is this call's own: it becomes the new residual in place (no
            # full-size temporary). Not when it is the caller's tensor, nor the reconstruction's
            # memory (a lossless codec may return its input).
            self._residuals[name] = torch.from_numpy(np.subtract(acc.numpy(), recon.numpy(), out=acc.numpy()))
        else:
            self._residuals[name] = acc - recon
        return enc, recon

    def residual(self, name: str) -> torch.Tensor | None:
        return self._residuals.get(name)

    def flat_residual(self, layout: Layout, device: torch.device) -> torch.Tensor | None:
        """The residuals of ``layout``'s tensors back to back in one float32 buffer on ``device``
        (zeros where a tensor has none), or None when none has one. The buffer :meth:`keep_flat`
        kept last is returned as it is (no copy, no kernel) while every residual is still its view;
        else one is assembled. Raises ``ValueError`` as :meth:`encode` does on a residual of
        another shape."""
        kept = self._flat
        if (
            kept is not None
            and kept[0] == layout
            and all(self._residuals.get(name) is view for name, view in kept[2].items())
        ):
            return kept[1] if kept[1].device == device else kept[1].to(device)
        found = [self._residuals.get(name) for name in layout.names]
        if all(r is None for r in found):
            return None
        parts = []
        for name, shape, n, r in zip(layout.names, layout.shapes, layout.numels, found, strict=True):
            if r is None:
                parts.append(torch.zeros(n, dtype=torch.float32, device=device))
                continue
            if tuple(r.shape) != tuple(shape):
                raise ValueError(f"residual for {name!r} has shape {list(r.shape)}, tensor has {list(shape)}")
            parts.append(r.reshape(-1).to(device=device, dtype=torch.float32))
        return torch.cat(parts)

    def keep_flat(self, layout: Layout, flat: torch.Tensor) -> None:
        """Make ``flat`` (``layout``'s tensors back to back) the residuals: each becomes its view,
        so :meth:`flat_residual` hands the buffer back next round without assembling it."""
        views = layout.views(flat)
        self._residuals.update(views)
        self._flat = (layout, flat, views)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residuals by tensor name (the tensors themselves, on their device, like PyTorch)."""
        return dict(self._residuals)

    def load_state_dict(self, state: Mapping[str, torch.Tensor], device: torch.device | str | None = None) -> None:
        """Replace the residuals with ``state`` (moved to ``device`` when given)."""
        loaded: dict[str, torch.Tensor] = {}
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"residual {name!r} is a {type(value).__name__}, not a tensor")
            t = value.detach().to(torch.float32)
            loaded[name] = t.to(device) if device is not None else t
        self._residuals = loaded


def _cpu_f32(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether NumPy may take ``a`` and ``b``: contiguous float32 CPU tensors of one shape, no
    autograd."""
    return (
        all(
            t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and not t.requires_grad
            for t in (a, b)
        )
        and a.shape == b.shape
    )


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
