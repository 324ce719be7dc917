"""GridFit: a reply is judged by where it takes the model (``|W + delta|`` at the positions it
changes), not by its size alone; an aggregate by every value."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcomp.codecs.lattice import K_LIMIT
from fedcomp.errors import PayloadError
from fedcomp.flower.grid_fit import GridFit

LIMIT = (K_LIMIT - 1) * 2.0**-20  # exponent -20: |W| < about 16


def _fit() -> GridFit:
    w = torch.zeros(8)
    w[0] = 15.0  # near the bound: max |W| + max |delta| says "maybe" for any delta over 1
    return GridFit({"w": w, "v": torch.zeros(3)}, {"w": -20, "v": -20})


def test_a_large_step_where_the_weights_are_small_fits() -> None:
    fit = _fit()
    fit.check([("w", np.array([3, 5]), 10.0)])  # SBC-like: positions and one value
    fit.check([("w", None, np.array([0, 0, 0, 10, 0, 0, 0, 0], np.float32))])  # dense
    fit.check_dense({"w": torch.tensor([-30.0, 0, 0, 0, 0, 0, 0, 0])})  # 15 - 30: |W| = 15 (no raise)


@pytest.mark.parametrize(
    "part",
    [
        ("w", np.array([0]), 1.0),  # 15 + 1 = 16 > LIMIT
        ("w", np.array([1, 2]), np.array([0.5, -17.0], np.float32)),
        ("v", None, np.array([0.0, 1e30, 0.0])),
    ],
)
def test_a_step_past_the_grid_is_refused_naming_the_tensor(part: tuple) -> None:
    fit = _fit()
    with pytest.raises(PayloadError, match=rf"tensor '{part[0]}'.*lattice downlink's grid") as err:
        fit.check([part])
    assert f"{LIMIT:.4g}" in str(err.value)


def test_with_slack_a_reply_is_refused_only_that_many_times_past_the_bound() -> None:
    fit = GridFit({"w": torch.zeros(4)}, {"w": -20}, slack=4.0)
    fit.check([("w", None, np.array([3.9 * LIMIT, 0, 0, 0]))])  # (past the bound: the mean may not be)
    with pytest.raises(PayloadError, match=r"4 times past the lattice downlink's grid"):
        fit.check([("w", np.array([2]), 4.0 * LIMIT)])
    assert fit.off_grid({"w": torch.tensor([LIMIT, 0, 0, 0])}) == "w"  # (the aggregate: exact)


def test_a_tensor_off_the_grid_list_is_not_checked_and_off_grid_names_the_first() -> None:
    fit = _fit()
    fit.check([("other", None, np.array([1e30]))])  # (no grid: not the lattice's)
    assert fit.off_grid({"w": torch.full((8,), LIMIT * (1 - 1e-7)), "v": torch.zeros(3)}) is None
    assert fit.off_grid({"w": torch.zeros(8), "v": torch.tensor([0.0, -LIMIT, 0.0])}) == "v"
    assert fit.off_grid({"w": torch.tensor([float("nan")] * 8)}) == "w"
