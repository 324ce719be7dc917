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

import math
from collections.abc import Mapping, Sequence

import torch

from fedcomp.codecs.pca import (
    DEFAULT_MAX_SAMPLES,
    DEFAULT_MAX_SLICE,
    Basis,
    Compressor,
    aggregate,
    compress,
    decompress,
    num_slices,
)
from fedcomp.errors import ConfigError, check_number

__all__ = [
    "DEFAULT_MAX_SAMPLES",
    "DEFAULT_MAX_SLICE",
    "Basis",
    "Compressor",
    "aggregate",
    "compress",
    "decompress",
    "fit_compressor",
    "num_slices",
    "refresh_compressor",
]


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
    eps = check_number("eps", eps, low=0.0, high=1.0, low_open=False, high_open=True)
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


def _fit_one(flats: list[torch.Tensor], d: int, eps: float, max_samples: int, gen: torch.Generator) -> Basis | None:
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
