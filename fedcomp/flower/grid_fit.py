"""Whether a reply would take the model where the lattice downlink cannot follow.

The lattice downlink (:mod:`fedcomp.codecs.lattice`) fixes each tensor's grid ``h = 2**e`` in the
run's first movement of the model (:func:`~fedcomp.flower.replica.grid_exponents`, with room for
the weights to grow 4x) and sends ``round(W / h)``, which must stay below ``2**24`` in magnitude.
A model past it cannot be sent: the replica's next step raises, and the run ends. Every value a
finite reply can carry was let through before, so one client's update of 1e30 (finite, no
``max-update-norm`` set) ended a run whose downlink was ``lattice``.

Now each train reply is checked before it is added: a reply that would take a value of the model
to ``|W + delta| >= REPLY_SLACK * (2**24 - 1) * h`` at a position it changes is rejected (the round
goes on with the others). The slack lets an honest outlier through (a client whose running
variance is a few times everyone else's, on skewed data: the others' replies average it back onto
the grid), and no honest reply reaches it (the grid holds 4x the largest weight when it is set,
1024x the largest running statistic). What the replies average to is checked exactly
(:meth:`GridFit.off_grid`), the inner strategy's own step (momentum, adaptive moments) included:
a round whose aggregate leaves the grid keeps the model as it was, with an error line, rather than
end the run (the reference app's ``max-empty-rounds`` ends a run whose rounds keep doing so). The
check costs one comparison per reply tensor (``max|W| + max|delta|`` against the bound), and a
look at the positions only where that fails.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from fedcomp.codecs.lattice import K_LIMIT
from fedcomp.errors import PayloadError

__all__ = ["REPLY_SLACK", "GridFit"]

#: How far past the grid's bound one reply may take a value before it is rejected by itself.
REPLY_SLACK = 1024.0


class GridFit:
    """One round's check of replies against the lattice ``grid`` (tensor -> exponent) around the
    global model ``model`` the replies are deltas against."""

    def __init__(self, model: Mapping[str, torch.Tensor], grid: Mapping[str, int], slack: float = 1.0) -> None:
        self._model = model
        self.slack = slack
        #: Per tensor, the magnitude a model value must stay under: ``round(x / h)`` of anything
        #: below it is at most ``2**24 - 1`` (and the bound is exact in float32).
        self.limits = {k: (K_LIMIT - 1) * math.ldexp(1.0, e) for k, e in grid.items()}
        self._peaks: dict[str, float] = {}  # max |W| per tensor, when first needed

    def _flat(self, name: str) -> np.ndarray:
        return self._model[name].detach().reshape(-1).to(torch.float64).numpy()

    def _peak(self, name: str) -> float:
        peak = self._peaks.get(name)
        if peak is None:
            t = self._model[name].detach()
            peak = self._peaks[name] = float(t.abs().max()) if t.numel() else 0.0
        return peak

    def check(self, parts: Iterable[tuple[str, np.ndarray | None, np.ndarray | float]]) -> None:
        """Raise :class:`PayloadError` naming the first tensor where ``W + delta`` reaches
        ``slack`` times the grid's bound; ``parts`` as
        :meth:`fedcomp.flower.weighted_sum.ReplyDelta.parts` gives them (finite)."""
        for name, positions, values in parts:
            bound = self.limits.get(name)
            if bound is None:
                continue
            limit = bound * self.slack
            arr = np.asarray(values)
            if not arr.size:
                continue
            step = max(float(arr.max()), -float(arr.min()))  # (no temporary of the tensor's size)
            if self._peak(name) + step < limit:
                continue  # (every honest reply of a run that fits its grid stops here)
            base = self._flat(name)
            reach = float(np.abs((base if positions is None else base[positions]) + arr).max())
            if reach >= limit:
                past = f"{self.slack:g} times past" if self.slack != 1 else "past"
                raise PayloadError(
                    name,
                    f"the update takes it to |W| = {reach:.4g}, {past} the lattice downlink's grid (|W| < "
                    f"{bound:.4g}, set by the run's first rounds): an update far larger than the others? "
                    "(max-update-norm bounds them)",
                )

    def check_dense(self, delta: Mapping[str, torch.Tensor]) -> None:
        """:meth:`check` of a dense model-space ``delta``."""
        self.check((k, None, _flat32(t)) for k, t in delta.items())

    def off_grid(self, model: Mapping[str, torch.Tensor]) -> str | None:
        """The first tensor of ``model`` (an aggregate) that leaves the grid, or None."""
        for name, t in model.items():
            limit = self.limits.get(name)
            if limit is not None and t.numel() and not float(t.detach().abs().max()) < limit:
                return name
        return None


def _flat32(t: torch.Tensor) -> np.ndarray:
    flat = t.detach().reshape(-1)
    return (flat if flat.dtype in (torch.float32, torch.float64) else flat.float()).numpy()
