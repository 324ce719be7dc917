"""Error feedback (residual accumulation): the memory half of GRACE's compressor/memory split.

SBC and 3LC are biased compressors: what one round drops must be sent later or training drifts.
``ErrorFeedback`` wraps any codec and keeps, per tensor name, what the decoded message lacked:
compensate (add the residual) -> compress -> update memory (residual = input - reconstruction).
Residuals live on the device of the tensors they belong to.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedcomp.codecs.base import Codec
from fedcomp.wire.payloads import EncodedTensor


class ErrorFeedback:
    """A stateful wrapper that gives any codec residual accumulation.

    ``encode`` has the codec's signature, so an ``ErrorFeedback`` can stand where a codec is
    used for encoding. ``codec`` may be swapped between rounds (e.g. a new sparsity p) without
    losing the residuals.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._residuals: dict[str, torch.Tensor] = {}

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
        acc = tensor.detach().to(torch.float32)
        residual = self._residuals.get(name)
        if residual is not None:
            if residual.shape != acc.shape:
                raise ValueError(
                    f"residual for {name!r} has shape {list(residual.shape)}, tensor has {list(acc.shape)}"
                )
            acc = acc + residual.to(acc.device)
        enc, recon = codec.encode_with_reconstruction(acc, name)
        recon = recon.to(torch.float32)
        self._residuals[name] = acc - recon
        return enc, recon

    def residual(self, name: str) -> torch.Tensor | None:
        return self._residuals.get(name)

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
