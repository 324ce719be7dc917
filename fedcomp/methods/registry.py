"""Every uplink and downlink method by its id: the one place that lists them.

The ``uplink-codec`` and ``downlink-codec`` run-config keys name an entry here. Adding a method is
one file with an :class:`~fedcomp.methods.base.UplinkMethod` (or ``DownlinkMethod``) subclass and
one line below; code outside this module looks methods up and never compares their names.
Applications may also call :func:`register_uplink` / :func:`register_downlink` at import time
(in a module both the ServerApp and the ClientApp import, so both sides know the method).
"""

from __future__ import annotations

from fedcomp.errors import ConfigError
from fedcomp.methods.base import DownlinkMethod, UplinkMethod
from fedcomp.methods.deft_uplink import DeftUplink
from fedcomp.methods.downlinks import DenseFP16Downlink, DenseFP32Downlink, IdentityDownlink, ThreeLCDownlink
from fedcomp.methods.gradiveq_uplink import GradiVeQUplink
from fedcomp.methods.lattice import LatticeDownlink
from fedcomp.methods.plain import DenseFP16Uplink, DenseFP32Uplink, IdentityUplink, SBCUplink, TopKUplink
from fedcomp.methods.sparse_downlinks import AutoDownlink, SparseFP16Downlink, SparseFP32Downlink
from fedcomp.methods.stc import STCUplink

__all__ = ["DOWNLINKS", "UPLINKS", "get_downlink", "get_uplink", "register_downlink", "register_uplink"]

UPLINKS: dict[str, type[UplinkMethod]] = {
    m.method_id: m
    for m in (
        SBCUplink,
        STCUplink,
        TopKUplink,
        DeftUplink,
        GradiVeQUplink,
        DenseFP32Uplink,
        DenseFP16Uplink,
        IdentityUplink,
    )
}

DOWNLINKS: dict[str, type[DownlinkMethod]] = {
    m.method_id: m
    for m in (
        ThreeLCDownlink,
        DenseFP32Downlink,
        DenseFP16Downlink,
        IdentityDownlink,
        LatticeDownlink,
        SparseFP32Downlink,
        SparseFP16Downlink,
        AutoDownlink,
    )
}


def get_uplink(method_id: str) -> type[UplinkMethod]:
    if method_id not in UPLINKS:
        raise ConfigError(f"uplink-codec: unknown uplink method {method_id!r}; known: {sorted(UPLINKS)}")
    return UPLINKS[method_id]


def get_downlink(method_id: str) -> type[DownlinkMethod]:
    if method_id not in DOWNLINKS:
        raise ConfigError(f"downlink-codec: unknown downlink method {method_id!r}; known: {sorted(DOWNLINKS)}")
    return DOWNLINKS[method_id]


def register_uplink(method: type[UplinkMethod]) -> type[UplinkMethod]:
    """Add an uplink method (usable as a class decorator); an id may be registered once."""
    _register(UPLINKS, method)
    return method


def register_downlink(method: type[DownlinkMethod]) -> type[DownlinkMethod]:
    """Add a downlink method (usable as a class decorator); an id may be registered once."""
    _register(DOWNLINKS, method)
    return method


def _register(table: dict, method: type) -> None:
    mid = getattr(method, "method_id", None)
    if not isinstance(mid, str) or not mid:
        raise ConfigError(f"{method.__name__}: a method needs a non-empty string method_id")
    if table.get(mid, method) is not method:
        raise ConfigError(f"method id {mid!r} is already registered by {table[mid].__name__}")
    table[mid] = method
