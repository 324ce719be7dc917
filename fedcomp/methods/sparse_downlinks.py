"""Downlinks for sparse aggregates: exact sparse deltas, and "auto", a per-round choice among downlinks.

``sparse-fp32`` sends every nonzero entry of ``W - R`` at its exact float32 value
(:class:`~fedcomp.codecs.sparse.Sparse`): under a sparse uplink the aggregate is nonzero only on
the union of the clients' positions, so the replica follows the model exactly at the cost of that
union. ``sparse-fp16`` sends float16 values above a relative threshold (the codec's documented
``2**-10``), so float16's rounding residual, which ``W - R`` keeps, is not resent as noise.

``auto`` is not a codec but a policy (:mod:`fedcomp.flower.downlink_policy`): each round the server
tries every downlink in ``downlink-candidates`` on a scratch copy of the replica and sends the
smallest whose replica lag ``||W - R|| / ||W - W_prev||`` is at most ``replica-lag-max``; if none
is, the one with the least lag. A candidate is a downlink method id, optionally with ``*N``: up to
N passes on what is still missing (as ``downlink-passes``, stopping once the bound is met).
``downlink-passes`` itself does not apply under ``auto`` (the candidates say the passes); a
``lattice`` candidate is not supported (its replica grid and merged catch-ups assume every delta
is a lattice one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedcomp.codecs.sparse import FP16_THRESHOLD
from fedcomp.errors import ConfigError
from fedcomp.methods.base import DownlinkMethod

if TYPE_CHECKING:
    from fedcomp.methods.config import CompressionConfig

__all__ = ["AutoDownlink", "SparseFP16Downlink", "SparseFP32Downlink", "parse_candidates"]

#: Most passes one candidate may make (as ``downlink-passes``).
MAX_PASSES = 8


class SparseFP32Downlink(DownlinkMethod):
    """Every nonzero entry of the delta, float32 values: the replica equals the model."""

    method_id = "sparse-fp32"

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        return {"id": "sparse", "values": "float32", "threshold": 0.0}


class SparseFP16Downlink(DownlinkMethod):
    """Entries above ``2**-10`` of the largest, float16 values (fedcomp.codecs.sparse's bound)."""

    method_id = "sparse-fp16"

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        return {"id": "sparse", "values": "float16", "threshold": FP16_THRESHOLD}


def parse_candidates(text: str) -> list[tuple[type[DownlinkMethod], int]]:
    """``"3lc,3lc*2,sparse-fp16"`` -> the methods with their most passes, in order; raise
    :class:`ConfigError` naming the bad part (unknown method, a policy among them, bad ``*N``)."""
    from fedcomp.methods.registry import DOWNLINKS

    out: list[tuple[type[DownlinkMethod], int]] = []
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or not all(parts):
        raise ConfigError(f"downlink-candidates: must be a comma-separated list of downlink methods, not {text!r}")
    for part in parts:
        mid, star, n = part.partition("*")
        mid = mid.strip()
        passes = 1
        if star:
            if not n.strip().isdigit() or not 1 <= int(n) <= MAX_PASSES:
                raise ConfigError(f"downlink-candidates: {part!r}: passes after '*' must be 1 to {MAX_PASSES}")
            passes = int(n)
        method = DOWNLINKS.get(mid)
        if method is None:
            raise ConfigError(f"downlink-candidates: unknown downlink method {mid!r}; known: {sorted(DOWNLINKS)}")
        if issubclass(method, AutoDownlink):
            raise ConfigError(f"downlink-candidates: {mid!r} is a policy, not a downlink")
        out.append((method, passes))
    return out


class AutoDownlink(DownlinkMethod):
    """The smallest of ``downlink-candidates`` that keeps the replica lag under ``replica-lag-max``,
    chosen every round by the server (:mod:`fedcomp.flower.downlink_policy`).

    ``codec_config`` is the first candidate's: what a client is told before any choice is made.
    After each choice the wrapper names the chosen method's codec in that round's downlinks.
    """

    method_id = "auto"

    @classmethod
    def candidates(cls, config: CompressionConfig) -> list[tuple[type[DownlinkMethod], int]]:
        return parse_candidates(config.downlink_candidates)

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        first, _ = cls.candidates(config)[0]
        return first.codec_config(config, server_round)

    @classmethod
    def summary(cls, config: CompressionConfig) -> str:
        return (
            f"auto (the smallest of {config.downlink_candidates} with replica lag <= {config.replica_lag_max:g}, "
            "else the least lag)"
        )
