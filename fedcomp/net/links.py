"""Network link profiles: each client's uplink/downlink rate and latency (no torch import here).

A client's link is three numbers: ``uplink-mbps`` and ``downlink-mbps`` (Mbit/s, 1 Mbit = 10^6
bits) and ``latency-ms`` (one-way: a round pays it twice, once down and once up). They reach a
client as

* **node config** on the Deployment Engine: ``flower-supernode --node-config
  "partition-id=0 num-partitions=3 uplink-mbps=10.0 downlink-mbps=100.0 latency-ms=20.0"``
  (``python -m fedcomp.deploy`` writes these);
* the run-config key ``link-profiles`` in a simulation (every simulated SuperNode has the same
  node config), written ``"UP,DOWN,LATENCY;UP,DOWN,LATENCY;..."`` and cycled over partitions:
  ``"10,10,20;100,100,5"`` gives partitions 0, 2, 4, ... 10/10 Mbit/s with 20 ms and partitions
  1, 3, 5, ... 100/100 Mbit/s with 5 ms. A node config that names a link wins over the key.

Values are validated here, once, with messages naming the node and the key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedcomp.errors import ConfigError

__all__ = [
    "LINK_KEYS",
    "MAX_LATENCY_MS",
    "MAX_MBPS",
    "LinkProfile",
    "check_number",
    "parse_link_profiles",
    "profile_for_partition",
]

UPLINK_KEY, DOWNLINK_KEY, LATENCY_KEY = "uplink-mbps", "downlink-mbps", "latency-ms"
LINK_KEYS = (UPLINK_KEY, DOWNLINK_KEY, LATENCY_KEY)
#: Upper bounds that catch unit mistakes (bit/s written where Mbit/s was meant, s for ms).
MAX_MBPS = 1e6  # 1 Tbit/s
MAX_LATENCY_MS = 600_000.0  # 10 minutes


def check_number(value: Any, key: str, *, lo: float, lo_open: bool, hi: float, where: str = "") -> float:
    """``value`` as a float if it is a finite number in range, else ConfigError naming ``key``."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{prefix}{key}: must be a number (got {value!r})")
    v = float(value)
    if not math.isfinite(v):
        raise ConfigError(f"{prefix}{key}: must be finite (got {value!r})")
    if (v <= lo) if lo_open else (v < lo):
        raise ConfigError(f"{prefix}{key}: must be {'>' if lo_open else '>='} {lo:g} (got {value!r})")
    if v > hi:
        raise ConfigError(f"{prefix}{key}: must be <= {hi:g} (got {value!r}; units are Mbit/s and ms)")
    return v


@dataclass(frozen=True)
class LinkProfile:
    """One client's link: rates in Mbit/s (10^6 bit/s), one-way latency in ms."""

    uplink_mbps: float
    downlink_mbps: float
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        check_number(self.uplink_mbps, UPLINK_KEY, lo=0.0, lo_open=True, hi=MAX_MBPS)
        check_number(self.downlink_mbps, DOWNLINK_KEY, lo=0.0, lo_open=True, hi=MAX_MBPS)
        check_number(self.latency_ms, LATENCY_KEY, lo=0.0, lo_open=False, hi=MAX_LATENCY_MS)

    # --- time on the wire ----------------------------------------------------------------------

    def uplink_seconds(self, nbytes: int | float) -> float:
        """Seconds to send ``nbytes`` up (transfer only, no latency)."""
        return float(nbytes) * 8.0 / (self.uplink_mbps * 1e6)

    def downlink_seconds(self, nbytes: int | float) -> float:
        """Seconds to receive ``nbytes`` (transfer only, no latency)."""
        return float(nbytes) * 8.0 / (self.downlink_mbps * 1e6)

    def uplink_bytes_in(self, seconds: float) -> float:
        """Bytes the uplink carries in ``seconds`` (0 for a non-positive time)."""
        return max(0.0, seconds) * self.uplink_mbps * 1e6 / 8.0

    # --- node config ---------------------------------------------------------------------------

    def to_node_config(self) -> dict[str, float]:
        return {
            UPLINK_KEY: float(self.uplink_mbps),
            DOWNLINK_KEY: float(self.downlink_mbps),
            LATENCY_KEY: float(self.latency_ms),
        }

    def spec(self) -> str:
        """The ``UP,DOWN,LATENCY`` form :func:`parse_link_profiles` reads."""
        return f"{self.uplink_mbps:g},{self.downlink_mbps:g},{self.latency_ms:g}"

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any], where: str = "node config") -> LinkProfile | None:
        """The link a node config names; None when it names none of the three keys.

        A node config that names some but not all of them, or a bad value, is a ConfigError
        naming ``where`` and the key.
        """
        present = [k for k in LINK_KEYS if k in node_config]
        if not present:
            return None
        for k in (UPLINK_KEY, DOWNLINK_KEY):
            if k not in node_config:
                raise ConfigError(
                    f"{where}: {k}: missing (the link needs {UPLINK_KEY} and {DOWNLINK_KEY}; {LATENCY_KEY} defaults to 0)"
                )
        up = check_number(node_config[UPLINK_KEY], UPLINK_KEY, lo=0.0, lo_open=True, hi=MAX_MBPS, where=where)
        down = check_number(node_config[DOWNLINK_KEY], DOWNLINK_KEY, lo=0.0, lo_open=True, hi=MAX_MBPS, where=where)
        lat = check_number(
            node_config.get(LATENCY_KEY, 0.0), LATENCY_KEY, lo=0.0, lo_open=False, hi=MAX_LATENCY_MS, where=where
        )
        return cls(up, down, lat)


def parse_link_profiles(text: str, key: str = "link-profiles") -> list[LinkProfile]:
    """``"10,10,20;100,100,5"`` -> two profiles (up Mbit/s, down Mbit/s, latency ms each).

    The latency may be left out (``"10,100"`` = 0 ms). An empty string gives no profiles.
    """
    text = text.strip()
    if not text:
        return []
    out = []
    for i, part in enumerate(text.split(";")):
        fields = [f.strip() for f in part.split(",")]
        if len(fields) not in (2, 3) or not all(fields):
            raise ConfigError(f"{key}: profile {i} {part.strip()!r}: expected 'UP,DOWN[,LATENCY]' (Mbit/s, Mbit/s, ms)")
        try:
            nums = [float(f) for f in fields]
        except ValueError:
            raise ConfigError(f"{key}: profile {i} {part.strip()!r}: not numbers") from None
        where = f"{key}: profile {i}"
        up = check_number(nums[0], UPLINK_KEY, lo=0.0, lo_open=True, hi=MAX_MBPS, where=where)
        down = check_number(nums[1], DOWNLINK_KEY, lo=0.0, lo_open=True, hi=MAX_MBPS, where=where)
        lat = check_number(
            nums[2] if len(nums) == 3 else 0.0, LATENCY_KEY, lo=0.0, lo_open=False, hi=MAX_LATENCY_MS, where=where
        )
        out.append(LinkProfile(up, down, lat))
    return out


def profile_for_partition(profiles: Sequence[LinkProfile], partition_id: int) -> LinkProfile | None:
    """The profile partition ``partition_id`` gets (cycled); None when there are none."""
    if not profiles:
        return None
    return profiles[partition_id % len(profiles)]


def link_of(
    node_config: Mapping[str, Any], profiles: Sequence[LinkProfile], where: str = "node config"
) -> LinkProfile | None:
    """This client's link: from its node config if it names one, else the run's profiles cycled
    over ``partition-id`` (0 when absent), else None."""
    own = LinkProfile.from_node_config(node_config, where)
    if own is not None:
        return own
    pid = node_config.get("partition-id", 0)
    return profile_for_partition(
        profiles, int(pid) if isinstance(pid, int | float) and not isinstance(pid, bool) else 0
    )
