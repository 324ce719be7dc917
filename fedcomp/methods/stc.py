"""Sparse Ternary Compression uplink (Sattler et al. 2019): one :class:`~fedcomp.codecs.stc.STC`
codec on every large tensor, error feedback in the client's residual."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedcomp.methods.plain import FractionUplink

if TYPE_CHECKING:
    from fedcomp.methods.config import CompressionConfig

__all__ = ["STCUplink"]


class STCUplink(FractionUplink):
    """Sparse Ternary Compression: the top fraction p of each tensor by magnitude, sent as
    ``sign * mu`` with one magnitude ``mu`` per tensor, Golomb positions and one sign bit each.

    STC has no setting of its own: its fraction kept is the ``sbc-p`` schedule (what SBC keeps
    per side, STC keeps in all), so ``sbc-p``, ``sbc-p-min``/``sbc-p-max`` and the bandwidth
    policy apply to it unchanged. ``sbc-mode`` does not: STC always selects exactly.
    """

    method_id = "stc"
    P_MAX = 1.0

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        return {"id": "stc", "p": config.sbc_p.at(server_round)}
