"""The ``--run-config`` text both command lines read (``python -m fedcomp run`` and
``python -m fedcomp.deploy``): ``key=value`` pairs whose values are TOML scalars, as for
``flwr run --run-config``, except that an unquoted word is a string (``uplink-codec=deft``), where
Flower refuses the whole text. Both commands hand Flower a TOML file of the parsed values."""

from __future__ import annotations

import re
import tomllib
from typing import Any

from fedcomp.errors import ConfigError

__all__ = ["parse_run_config"]

_PAIR = re.compile(r"""\s*([^\s=]+)=('[^']*'|"[^"]*"|\S*)""")


def parse_run_config(text: str) -> dict[str, Any]:
    """``"k1=1 k2='a b' k3=true k4=deft"`` -> ``{"k1": 1, "k2": "a b", "k3": True, "k4": "deft"}``.

    Values are TOML scalars as in ``flwr run --run-config``; one that is not valid TOML (an
    unquoted word, ``steps:0.01@1,0.001@20``) is taken as a string, which is what its writer
    meant. Raise :class:`ConfigError` for text that is not ``key=value`` pairs, or that gives a
    key twice (repeated ``--run-config`` options may override one another; one text may not).
    """
    out: dict[str, Any] = {}
    pos, text = 0, text.strip()
    while pos < len(text):
        m = _PAIR.match(text, pos)
        if m is None:
            bad = text[pos:].split()[0]
            raise ConfigError(
                f"run config: cannot read {bad!r}: expected key=value pairs, e.g. \"sbc-p=0.01 dataset='mnist'\""
            )
        key, raw = m.group(1), m.group(2)
        if not raw:
            raise ConfigError(f"{key}: no value after '=' (strings may be quoted: {key}='...')")
        value = _scalar(key, raw)
        if key in out:
            raise ConfigError(f"{key}: given twice in one --run-config ({out[key]!r}, then {value!r})")
        out[key] = value
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


def _scalar(key: str, raw: str) -> Any:
    if raw[0] in "'\"":
        return raw[1:-1]
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # an unquoted string
    if not isinstance(value, bool | int | float | str):
        raise ConfigError(f"{key}: expected a number, true/false or a string (got {raw!r})")
    return value
