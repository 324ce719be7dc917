"""Sparse Ternary Compression uplink (Sattler et al. 2019): one :class:`~fedcomp.codecs.stc.STC`
codec on every large tensor, error feedback in the client's residual."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fedcomp.methods.base import UplinkMethod

if TYPE_CHECKING:
    from fedcomp.methods.config import CompressionConfig

__all__ = ["STCUplink"]


class STCUplink(UplinkMethod):
    """Sparse Ternary Compression: the top fraction p of each tensor by magnitude, sent as
    ``sign * mu`` with one magnitude ``mu`` per tensor, Golomb positions and one sign bit each.

    STC has no setting of its own: its fraction kept is the ``sbc-p`` schedule (what SBC keeps
    per side, STC keeps in all), so ``sbc-p``, ``sbc-p-min``/``sbc-p-max`` and the bandwidth
    policy apply to it unchanged. ``sbc-mode`` does not: STC always selects exactly.
    """

    method_id = "stc"
    adapts_p = True

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        return {"id": "stc", "p": config.sbc_p.at(server_round)}

    @classmethod
    def with_p(cls, codec_config: Mapping[str, Any], p: float) -> dict[str, Any]:
        return {**codec_config, "p": float(min(1.0, max(p, 1e-12)))}

    @classmethod
    def p_of(cls, codec_config: Mapping[str, Any]) -> float:
        return float(codec_config["p"])
