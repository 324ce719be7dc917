"""The one error type every decoder raises on bad input."""

from __future__ import annotations

import math
import numbers
import reprlib


class PayloadError(ValueError):
    """A payload could not be decoded: truncated, corrupted, hostile, or not the expected tensor.

    ``tensor`` names the tensor (empty when the failure is not tied to one, e.g. unparsable
    protobuf), ``reason`` says what was wrong. Catching this one class is enough to reject a
    client's update and go on with the others.
    """

    #: Longest reason kept: a reason may quote what a client sent (a name, a value, a field), and
    #: a hostile client's megabytes were kept whole, in every round's figures, results.json, the
    #: checkpoint and the log (a red-team audit: results.json grew 12 MB a round).
    MAX_REASON_CHARS = 1000

    def __init__(self, tensor: str, reason: str) -> None:
        self.tensor = tensor
        if len(reason) > self.MAX_REASON_CHARS:
            reason = f"{reason[: self.MAX_REASON_CHARS - 40]}... ({len(reason):,} characters)"
        self.reason = reason
        shown = tensor if len(tensor) <= 200 else tensor[:200] + "..."  # (a hostile name may be long)
        where = f"tensor {shown!r}" if tensor else "payload"
        super().__init__(f"{where}: {reason}")


_SHOWN = reprlib.Repr()  # (Python 3.11's takes no arguments)
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 80, 80, 6, 6, 4
_SHOWN.maxlevel = 2


def shown(value: object) -> str:
    """``repr(value)``, at most about 80 characters, built without the whole repr: for quoting
    what a client sent (a 300,000-element "weight", a 6 MB tensor name) in an error message."""
    return _SHOWN.repr(value)


class ConfigError(ValueError):
    """A codec or run configuration is invalid; the message names the bad key."""


class NoProgressError(RuntimeError):
    """``max-empty-rounds`` train rounds in a row, or every round of a shorter run, aggregated no
    client update: the run fails rather than evaluate the same model again and call it
    completed."""


def check_number(
    key: str, value: object, *, low: float, high: float, low_open: bool = True, high_open: bool = False
) -> float:
    """``value`` as a float when it is a real number (Python's or NumPy's, not a bool) in the
    interval from ``low`` to ``high``; else :class:`ConfigError` naming ``key`` and saying which was
    wrong, the type (``p="0.1"``: a string) or the range."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{key}: must be a number in {interval}, got {type(value).__name__} {value!r}")
    v = float(value)
    above = v > low if low_open else v >= low
    below = v < high if high_open else v <= high
    if not (above and below and math.isfinite(v)):
        raise ConfigError(f"{key}: must be in {interval}, got {value!r}")
    return v
