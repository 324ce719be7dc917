"""GradiVeQ's linear compressor: per-tensor PCA bases, compression, decompression, aggregation.

The maths a codec needs to encode and decode coefficients (``c = U^T (x - mu)``,
``x~ = U c + mu``), and the :class:`Compressor` the server broadcasts. Fitting a compressor from
sample updates is method logic and lives in :mod:`fedcomp.methods.gradiveq`, whose docstring
gives the paper, the loss and the departures from it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from fedcomp.codecs.base import TensorSpec
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.wire import payloads, serde

__all__ = [
    "DEFAULT_MAX_SAMPLES",
    "DEFAULT_MAX_SLICE",
    "Basis",
    "Compressor",
    "aggregate",
    "compress",
    "decompress",
    "num_slices",
]

#: Largest slice size a receiver accepts by default: U then holds at most 4096^2 floats (64 MiB).
DEFAULT_MAX_SLICE = 4096
#: Sample slices a fit uses per tensor at most (bounds the covariance's cost to N d^2).
DEFAULT_MAX_SAMPLES = 16384
#: How far a received basis column's norm may stray from 1 (float32 rounding is ~1e-7).
_NORM_TOL = 1e-3


def num_slices(numel: int, slice_size: int) -> int:
    """``ceil(numel / slice_size)``: slices of a tensor, the last one zero-padded."""
    return -(-numel // slice_size)


@dataclass(frozen=True, eq=False)
class Basis:
    """One tensor's compressor: ``basis`` U (``d x k`` float32, orthonormal columns, CPU) and
    ``whitening`` mu (``d`` float32). ``fit_loss`` is the eq.-6 loss on the fit's samples (a
    diagnostic; None when the basis came from the wire), ``samples`` how many slices it used."""

    basis: torch.Tensor
    whitening: torch.Tensor
    fit_loss: float | None = None
    samples: int = 0

    @property
    def slice_size(self) -> int:
        return int(self.basis.shape[0])

    @property
    def dim(self) -> int:
        return int(self.basis.shape[1])

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """U and mu on ``device`` (no copy on CPU)."""
        return self.basis.to(device), self.whitening.to(device)


class Compressor:
    """A versioned set of per-tensor bases; a tensor without one is sent dense.

    Immutable once built. ``version`` (>= 1) is what payloads quote; a refresh makes a new
    Compressor with a higher version. Build one with :func:`fit_compressor`, or on a client with
    :meth:`from_wire` from what the server broadcast.
    """

    def __init__(self, version: int, bases: Mapping[str, Basis]) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version < 2**64:
            raise ConfigError(f"version: must be an integer in [1, 2**64), got {version!r}")
        checked: dict[str, Basis] = {}
        for name, b in bases.items():
            u, mu = b.basis, b.whitening
            if u.dtype != torch.float32 or mu.dtype != torch.float32 or u.dim() != 2 or mu.dim() != 1:
                raise ConfigError(f"{name}: basis must be a float32 d x k matrix and whitening a float32 d-vector")
            d, k = u.shape
            if not (d >= 1 and 1 <= k <= d and mu.shape[0] == d):
                raise ConfigError(
                    f"{name}: basis {tuple(u.shape)} / whitening {tuple(mu.shape)} do not fit 1 <= k <= d"
                )
            checked[name] = Basis(u.detach().cpu().contiguous(), mu.detach().cpu().contiguous(), b.fit_loss, b.samples)
        self.version = version
        self.bases: Mapping[str, Basis] = MappingProxyType(checked)
        self._digest: str | None = None

    def compresses(self, name: str) -> bool:
        """Whether tensor ``name`` is compressed (else the caller sends it dense)."""
        return name in self.bases

    def basis(self, name: str) -> Basis:
        """The basis of ``name``; :class:`KeyError` naming the tensor when it has none."""
        try:
            return self.bases[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not compressed by GradiVeQ compressor version {self.version}") from None

    @property
    def digest(self) -> str:
        """SHA-256 (hex, first 16 bytes) of the serialized compressor: equal digests, equal bases."""
        if self._digest is None:
            self._digest = hashlib.sha256(serde.compressor_to_bytes(self.to_wire())).hexdigest()[:32]
        return self._digest

    def wire_bytes(self) -> int:
        """Size of the broadcast (``GradiVeQCompressor`` serialized): the downlink cost of a refresh."""
        return len(serde.compressor_to_bytes(self.to_wire()))

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}: d={b.slice_size} k={b.dim}" for n, b in self.bases.items())
        return f"Compressor(version={self.version}, {{{dims}}})"

    # --- wire -----------------------------------------------------------------------------

    def to_wire(self) -> payloads.GradiVeQCompressor:
        """The broadcast form: only compressed tensors are listed (absent means dense)."""
        return payloads.GradiVeQCompressor(
            version=self.version,
            tensors=tuple(
                payloads.GradiVeQBasis(
                    name=name,
                    slice_size=b.slice_size,
                    dim=b.dim,
                    basis=_le_bytes(b.basis),
                    whitening=_le_bytes(b.whitening),
                )
                for name, b in self.bases.items()
            ),
        )

    @classmethod
    def from_wire(
        cls,
        wire: payloads.GradiVeQCompressor,
        specs: Sequence[TensorSpec],
        max_slice: int = DEFAULT_MAX_SLICE,
    ) -> Compressor:
        """Check an untrusted broadcast against the model's tensors and build the compressor.

        Raises :class:`PayloadError` (naming the tensor where there is one) for: a version
        outside ``[1, 2**64)``; a tensor the model does not have, or listed twice; ``d == 0``,
        ``d > max_slice`` or ``d > numel``; ``k > d``; basis or whitening of the wrong byte
        length; non-finite values; a basis column whose norm is not 1 (within 1e-3; full
        orthonormality, ``d k^2`` work, is not checked: a skewed basis costs accuracy, never
        memory). ``dim == 0`` means "sent dense" and must come with empty basis and whitening.
        Nothing is allocated before the byte lengths match ``d`` and ``k``, which are bounded by
        ``max_slice`` and the model's sizes.
        """
        if not isinstance(wire, payloads.GradiVeQCompressor):
            raise PayloadError("", f"expected a GradiVeQCompressor, got {type(wire).__name__}")
        version = wire.version
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version < 2**64:
            raise PayloadError("", f"compressor version {version!r} is not in [1, 2**64)")
        numels = {s.name: s.numel for s in specs}
        bases: dict[str, Basis] = {}
        seen: set[str] = set()
        for t in wire.tensors:
            name = t.name
            if name not in numels:
                raise PayloadError(name, "the compressor names a tensor the model does not have")
            if name in seen:
                raise PayloadError(name, "the compressor lists the tensor twice")
            seen.add(name)
            d, k, numel = t.slice_size, t.dim, numels[name]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (d, k)):
                raise PayloadError(name, "slice_size and dim must be integers")
            if k == 0:
                if t.basis or t.whitening:
                    raise PayloadError(name, "dim 0 (sent dense) with a non-empty basis or whitening")
                continue
            if d < 1:
                raise PayloadError(name, f"slice_size {d} must be at least 1")
            if d > max_slice:
                raise PayloadError(name, f"slice_size {d} exceeds the limit {max_slice}")
            if d > numel:
                raise PayloadError(name, f"slice_size {d} exceeds the tensor's {numel} elements")
            if not 1 <= k <= d:
                raise PayloadError(name, f"dim {k} is not in [1, slice_size {d}]")
            if len(t.basis) != d * k * 4:
                raise PayloadError(name, f"basis is {len(t.basis)} bytes, expected d*k*4 = {d * k * 4}")
            if len(t.whitening) != d * 4:
                raise PayloadError(name, f"whitening is {len(t.whitening)} bytes, expected d*4 = {d * 4}")
            u = _from_le_bytes(t.basis).reshape(d, k)
            mu = _from_le_bytes(t.whitening)
            if not (bool(torch.isfinite(u).all()) and bool(torch.isfinite(mu).all())):
                raise PayloadError(name, "basis or whitening holds NaN or infinite values")
            norms = torch.linalg.vector_norm(u.double(), dim=0)
            if not bool(((norms - 1).abs() <= _NORM_TOL).all()):
                raise PayloadError(name, "basis columns must have unit norm")
            bases[name] = Basis(u, mu)
        return cls(version, bases)


def _le_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().numpy().astype("<f4", copy=False).tobytes()


def _from_le_bytes(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32))


# --- compress / decompress / aggregate ------------------------------------------------------


def _slices(flat: torch.Tensor, d: int) -> torch.Tensor:
    """``flat`` as a (ceil(n/d), d) float32 matrix, the last row zero-padded (a view when n % d == 0)."""
    x = flat.reshape(-1).to(torch.float32)
    n = x.numel()
    pad = num_slices(n, d) * d - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(-1, d)


def compress(compressor: Compressor, name: str, flat: torch.Tensor) -> torch.Tensor:
    """Coefficients ``c = U^T (x - mu)`` of every slice of ``flat``: (num_slices, k) float32 on
    ``flat``'s device. Computed as ``X U - mu^T U`` (one pass over the tensor, no centred copy).
    :class:`KeyError` when ``name`` has no basis."""
    b = compressor.basis(name)
    u, mu = b.on(flat.device)
    x = _slices(flat, b.slice_size)
    return torch.mm(x, u).sub_(mu @ u)


def decompress(
    compressor: Compressor, name: str, coeffs: torch.Tensor, numel: int, weight_sum: float = 1.0
) -> torch.Tensor:
    """``U c + weight_sum * mu`` for every slice, flattened and cut to ``numel`` (float32, on
    ``coeffs``' device).

    For one update ``weight_sum`` is 1. For ``coeffs = sum_i w_i c_i`` pass ``weight_sum =
    sum_i w_i``: the result is ``sum_i w_i decompress(c_i)`` (linearity; module docstring).
    """
    b = compressor.basis(name)
    d, k = b.slice_size, b.dim
    s = num_slices(numel, d)
    if tuple(coeffs.shape) != (s, k):
        raise ValueError(f"tensor {name!r}: coefficients {tuple(coeffs.shape)}, expected ({s}, {k})")
    u, mu = b.on(coeffs.device)
    out = torch.addmm(mu.unsqueeze(0), coeffs.to(torch.float32), u.t(), beta=float(weight_sum))
    return out.reshape(-1)[:numel]


def aggregate(
    compressor: Compressor,
    name: str,
    coeffs: Sequence[torch.Tensor],
    weights: Sequence[float],
    numel: int,
) -> torch.Tensor:
    """The server's step: ``decompress(sum_i w_i c_i, weight_sum=sum_i w_i)``, one decompression
    for all clients. Normalised weights (summing to 1) give FedAvg's weighted mean."""
    if len(coeffs) != len(weights) or not coeffs:
        raise ValueError(f"tensor {name!r}: {len(coeffs)} coefficient sets and {len(weights)} weights")
    total = torch.zeros_like(coeffs[0], dtype=torch.float32)
    for c, w in zip(coeffs, weights, strict=True):
        total.add_(c, alpha=float(w))
    return decompress(compressor, name, total, numel, weight_sum=float(sum(weights)))
