"""GradiVeQ (Yu et al., NeurIPS 2018): a linear, PCA-fitted compressor for update tensors.

Each tensor is flattened (row-major), cut into slices of ``d`` adjacent values (the last slice
zero-padded) and every slice ``x`` is mapped to ``k`` coefficients ``c = U^T (x - mu)``, where
``U`` (``d x k``, orthonormal columns) and the whitening vector ``mu`` (``d``) come from a PCA of
sample slices. Decompression is ``x~ = U c + mu``. Because compression is affine and
decompression linear in ``c`` plus a multiple of ``mu``, compressed updates can be aggregated
*without decompressing them* (paper eq. 4-5):

    decompress(sum_i w_i c_i, weight_sum=sum_i w_i) == sum_i w_i decompress(c_i)

exactly in real arithmetic (up to float32 rounding in practice). With ``sum_i w_i = 1`` (FedAvg's
normalised weights) both sides are the weighted mean of the decompressed updates, and
``sum_i w_i c_i == compress(sum_i w_i x_i)``: the server sums coefficients and decompresses once.
That is also what makes the coefficients summable under secure aggregation (docs/GRADIVEQ.md).

One compressor per tensor, reused over all its slices: the paper's reuse factor "one compressor
per layer". A :class:`Compressor` bundles them with a version; the server refits it (a *refresh*)
from updates it received uncompressed and broadcasts it (``payloads.GradiVeQCompressor``);
coefficients name the version they were made with, and a codec rejects any other.

Departures from the paper, all deliberate:

* **Flattening.** The paper reorders a conv layer's gradients so that the values of all filters
  at one (depth, width, height) position are adjacent (its Fig. 3a) and picks ``d`` a multiple of
  the number of filters. fedcomp slices the tensor in plain row-major order (what the wire format
  and every other codec use), so a slice of ``d`` = the row length (``in * kh * kw``) is one
  filter / one output neuron's weights, and PCA runs across filters (the transpose of the
  paper's grouping). ``d`` is a per-tensor parameter; choose it as a multiple or divisor of the
  row length.
* **Samples.** The paper takes one slice per layer per iteration over ``L`` uncompressed
  iterations (time-domain samples of a single slice position, then reuses the result for the
  layer's other slices). In federated learning uncompressed rounds are few and costly, so
  :func:`fit_compressor` uses *every full slice of every collected update* (all positions, all
  clients, all uncompressed rounds), capped at ``max_samples`` slices drawn at random with a
  fixed seed. The ragged last slice of each tensor (zero-padded) is not used as a sample.
* **Which tensors.** The paper compresses convolutional layers only; fedcomp compresses any
  tensor of at least ``min_numel`` elements whose ``k`` meets the loss threshold with
  ``k <= max_dim``; the others are sent dense (``dim == 0`` / absent in the compressor).
* **Refresh schedule.** The paper alternates ``L`` uncompressed and ``T`` compressed iterations
  and may use QSGD for the uncompressed ones; fedcomp leaves the schedule to the caller
  (:func:`refresh_compressor` only fits and bumps the version).

The loss (paper eq. 6, whose typeset formula is lost in our copy of the text; this is the
standard PCA criterion it describes, "projected using the eigenvalues"): with the sample
covariance's eigenvalues ``l_1 >= ... >= l_d``,

    loss(k) = (l_{k+1} + ... + l_d) / (l_1 + ... + l_d)

the fraction of the samples' variance around ``mu`` that ``k`` components miss. On the samples
it equals ``sum ||x - x~||^2 / sum ||x - mu||^2`` exactly, and it bounds the paper's eq. 7 loss
``sum ||x - x~||^2 / sum ||x||^2`` from above (``sum ||x||^2 >= sum ||x - mu||^2``); so the chosen
``k`` keeps both at most ``eps`` on the samples. Held-out updates can do worse (the bench
measures it).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from fedcomp import serde
from fedcomp.codecs import payloads
from fedcomp.codecs.base import TensorSpec
from fedcomp.errors import ConfigError, PayloadError

__all__ = [
    "Basis",
    "Compressor",
    "fit_compressor",
    "refresh_compressor",
    "compress",
    "decompress",
    "aggregate",
    "num_slices",
    "DEFAULT_MAX_SLICE",
    "DEFAULT_MAX_SAMPLES",
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
                raise ConfigError(f"{name}: basis {tuple(u.shape)} / whitening {tuple(mu.shape)} do not fit 1 <= k <= d")
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


# --- fitting --------------------------------------------------------------------------------


def fit_compressor(
    samples: Mapping[str, Sequence[torch.Tensor]],
    version: int,
    slice_size: int | Mapping[str, int],
    eps: float,
    max_dim: int | None = None,
    min_numel: int = 1000,
    *,
    max_samples: int = DEFAULT_MAX_SAMPLES,
    seed: int = 0,
) -> Compressor:
    """Fit one basis per tensor by PCA of its slices (module docstring: samples, loss, departures).

    ``samples[name]`` are flattened (or any-shape) update tensors of that tensor, e.g. the dense
    updates of the clients in the uncompressed rounds; all must have the same number of
    elements. ``slice_size`` is ``d`` for every tensor or per tensor name (clamped to the
    tensor's size). For each tensor: ``mu`` = mean of the sample slices, ``U`` = the top ``k``
    eigenvectors of their covariance (float64, each column's largest entry made positive so the
    result is deterministic), ``k`` the smallest >= 1 with ``loss(k) <= eps``. A tensor is left
    out (sent dense) when it has fewer than ``min_numel`` elements, fewer than 2 full slices of
    samples, or when its ``k`` exceeds ``max_dim`` (default ``d - 1``: no gain otherwise); so
    every compressed tensor meets ``eps`` on its samples.

    At most ``max_samples`` slices per tensor are used (drawn without replacement by a
    generator seeded with ``seed``, afresh for each tensor): the fit costs ``O(max_samples d^2 + d^3)`` per tensor.
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 <= float(eps) < 1.0:
        raise ConfigError(f"eps: must be in [0, 1), got {eps!r}")
    if max_dim is not None and (isinstance(max_dim, bool) or not isinstance(max_dim, int) or max_dim < 1):
        raise ConfigError(f"max_dim: must be a positive integer or None, got {max_dim!r}")
    if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
        raise ConfigError(f"min_numel: must be a non-negative integer, got {min_numel!r}")
    if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 2:
        raise ConfigError(f"max_samples: must be an integer >= 2, got {max_samples!r}")
    sizes = slice_size if isinstance(slice_size, Mapping) else {name: slice_size for name in samples}
    for name, d in sizes.items():
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ConfigError(f"slice_size: must be a positive integer, got {d!r} for {name!r}")
    bases: dict[str, Basis] = {}
    for name, tensors in samples.items():
        if name not in sizes or not tensors:
            continue
        numels = {int(t.numel()) for t in tensors}
        if len(numels) != 1:
            raise ValueError(f"tensor {name!r}: samples of different sizes {sorted(numels)}")
        n = numels.pop()
        if n < max(min_numel, 1):
            continue
        d = min(int(sizes[name]), n)
        flats = [t.detach().reshape(-1).to(torch.float32).cpu() for t in tensors]
        basis = _fit_one(flats, d, float(eps), max_samples, torch.Generator().manual_seed(seed))
        if basis is None:
            continue
        if basis.dim > (max_dim if max_dim is not None else d - 1):
            continue
        bases[name] = basis
    return Compressor(version, bases)


def refresh_compressor(
    previous: Compressor | None,
    samples: Mapping[str, Sequence[torch.Tensor]],
    slice_size: int | Mapping[str, int],
    eps: float,
    **kwargs: object,
) -> Compressor:
    """Refit from new samples with the next version (1 when there was none), so coefficients made
    with ``previous`` are rejected from now on. ``kwargs`` go to :func:`fit_compressor`."""
    version = 1 if previous is None else previous.version + 1
    return fit_compressor(samples, version, slice_size, eps, **kwargs)  # type: ignore[arg-type]


def _fit_one(
    flats: list[torch.Tensor], d: int, eps: float, max_samples: int, gen: torch.Generator
) -> Basis | None:
    """PCA of the full d-slices of ``flats``; None when there are fewer than two."""
    full = flats[0].numel() // d  # the ragged last slice is not a sample
    total = full * len(flats)
    if total < 2:
        return None
    if total > max_samples:
        pick = torch.randperm(total, generator=gen)[:max_samples].sort().values
        which, pos = pick // full, pick % full
        rows = [flats[i][: full * d].view(full, d)[pos[which == i]] for i in range(len(flats))]
    else:
        rows = [f[: full * d].view(full, d) for f in flats]
    x = torch.cat(rows).to(torch.float64)
    mu = x.mean(0)
    x -= mu
    cov = (x.t() @ x) / x.shape[0]
    evals, evecs = torch.linalg.eigh(cov)  # ascending
    evals = evals.flip(0).clamp_(min=0.0)
    evecs = evecs.flip(1)
    # tail[k] = sum of eigenvalues after the first k (summed from the small end: no cancellation)
    tail = torch.cat([evals.flip(0).cumsum(0).flip(0), evals.new_zeros(1)])
    whole = float(tail[0])
    if whole <= 0.0 or not math.isfinite(whole):
        k, loss = 1, 0.0
    else:
        frac = tail / whole
        ok = (frac[1:] <= eps).nonzero()
        k = int(ok[0]) + 1 if ok.numel() else d
        loss = float(frac[k])
    u = evecs[:, :k]
    lead = u.abs().argmax(0)
    signs = torch.sign(u[lead, torch.arange(k)])
    u = u * torch.where(signs == 0, torch.ones_like(signs), signs)
    return Basis(u.to(torch.float32).contiguous(), mu.to(torch.float32), fit_loss=loss, samples=x.shape[0])
