"""Parameter checks name the key and say whether the type or the range was wrong."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedcomp.codecs import SBC, STC, ThreeLC, TopK
from fedcomp.errors import ConfigError, check_number


def test_a_string_is_named_as_the_wrong_type_not_the_wrong_range() -> None:
    with pytest.raises(ConfigError, match=r"^p: must be a number in \(0, 0\.5\], got str '0\.1'$"):
        SBC(p="0.1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^s: must be a number in \[1, 2\), got str '1'$"):
        ThreeLC(s="1")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 0.51, math.nan, math.inf])
def test_out_of_range_values_are_named_with_their_interval(bad: float) -> None:
    with pytest.raises(ConfigError, match=r"^p: must be in \(0, 0\.5\], got "):
        SBC(p=bad)


def test_numpy_scalars_are_numbers() -> None:
    assert SBC(p=np.float32(0.25)).p == pytest.approx(0.25)
    assert TopK(p=np.float64(0.5)).p == 0.5
    assert ThreeLC(s=np.int64(1)).s == 1.0
    assert STC(p=np.float32(0.5)).p == 0.5


def test_a_bool_is_not_a_number() -> None:
    with pytest.raises(ConfigError, match="got bool True"):
        check_number("x", True, low=0.0, high=1.0)


@pytest.mark.parametrize(
    ("low_open", "high_open", "value", "ok"),
    [
        (True, False, 0.0, False),
        (True, False, 1.0, True),
        (False, True, 0.0, True),
        (False, True, 1.0, False),
    ],
)
def test_the_interval_ends(low_open: bool, high_open: bool, value: float, ok: bool) -> None:
    if ok:
        assert check_number("x", value, low=0.0, high=1.0, low_open=low_open, high_open=high_open) == value
    else:
        with pytest.raises(ConfigError, match="^x: must be in "):
            check_number("x", value, low=0.0, high=1.0, low_open=low_open, high_open=high_open)
