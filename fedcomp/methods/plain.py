"""Uplink methods that are one codec applied to every tensor, with no server coordination:
SBC (the default), per-client top-k, dense fp32/fp16 and identity."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fedcomp.methods.base import UplinkMethod

if TYPE_CHECKING:
    from fedcomp.methods.config import CompressionConfig

__all__ = ["DenseFP16Uplink", "DenseFP32Uplink", "FractionUplink", "IdentityUplink", "SBCUplink", "TopKUplink"]


class FractionUplink(UplinkMethod):
    """A method whose codec keeps a fraction ``p`` of each tensor (the ``sbc-p`` schedule), which
    the bandwidth policy may pick per client and round, up to the codec's ``P_MAX``."""

    adapts_p = True
    P_MAX: float = 0.5

    @classmethod
    def with_p(cls, codec_config: Mapping[str, Any], p: float) -> dict[str, Any]:
        return {**codec_config, "p": float(min(cls.P_MAX, max(p, 1e-12)))}

    @classmethod
    def p_of(cls, codec_config: Mapping[str, Any]) -> float:
        return float(codec_config["p"])


class SBCUplink(FractionUplink):
    """Sparse Binary Compression: top-p per side, one mean per tensor, Golomb positions."""

    method_id = "sbc"

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        return {"id": "sbc", "p": config.sbc_p.at(server_round), "mode": config.sbc_mode}


class TopKUplink(UplinkMethod):
    """Each client's own top-k by magnitude with values (the baseline DEFT improves on)."""

    method_id = "topk"
    reports_selection = True

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        return {"id": "topk", "p": config.topk_density.at(server_round)}


class _Fixed(UplinkMethod):
    """A codec without parameters: the method id is the codec id.

    Lost updates: these methods keep the default behaviour (``client_keeps_sent`` /
    ``client_recover``). Their residual is zero (dense fp32, identity) or the fp16 rounding error,
    so a lost update becomes the whole residual and the next update carries it in full.
    """

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        return {"id": cls.method_id}


class DenseFP32Uplink(_Fixed):
    method_id = "dense-fp32"


class DenseFP16Uplink(_Fixed):
    method_id = "dense-fp16"


class IdentityUplink(_Fixed):
    method_id = "identity"
