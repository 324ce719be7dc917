"""Downlink methods: the codec that compresses each round's replica delta for every client."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedcomp.methods.base import DownlinkMethod

if TYPE_CHECKING:
    from fedcomp.methods.config import CompressionConfig

__all__ = ["DenseFP16Downlink", "DenseFP32Downlink", "IdentityDownlink", "ThreeLCDownlink"]


class ThreeLCDownlink(DownlinkMethod):
    """3LC: 3-value quantization with sparsity multiplier s, base-3^5 packing, zero runs."""

    method_id = "3lc"

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        return {"id": "3lc", "s": config.threelc_s.at(server_round), "zero_run": config.threelc_zero_run}


class _Fixed(DownlinkMethod):
    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        return {"id": cls.method_id}


class DenseFP32Downlink(_Fixed):
    method_id = "dense-fp32"


class DenseFP16Downlink(_Fixed):
    method_id = "dense-fp16"


class IdentityDownlink(_Fixed):
    method_id = "identity"
