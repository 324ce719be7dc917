"""A toy uplink method, as a user (or a later issue) adds one: this file plus one registry line.

``toy-half`` sends every tensor as fp16 with error feedback (the rounding error is carried to the
next round) and counts, on the server, the replies it decoded: a server-side hook of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedcomp.codecs import TensorSpec
from fedcomp.methods.base import Decoded, UplinkMethod
from fedcomp.methods.config import CompressionConfig
from fedcomp.methods.registry import register_uplink
from fedcomp.wire.payloads import EncodedUpdate


class HalfUplink(UplinkMethod):
    method_id = "toy-half"

    def __init__(self, config: CompressionConfig, weighted_mean: bool = True) -> None:
        super().__init__(config, weighted_mean)
        self.decoded: dict[int, int] = {}

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        return {"id": "dense-fp16"}

    def decode(
        self,
        update: EncodedUpdate,
        specs: Sequence[TensorSpec],
        model: Mapping[str, torch.Tensor],
        server_round: int,
        node: int,
    ) -> Decoded:
        self.decoded[server_round] = self.decoded.get(server_round, 0) + 1
        return super().decode(update, specs, model, server_round, node)

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        return {"toy_decoded": self.decoded.get(server_round, 0)}


def register() -> None:
    register_uplink(HalfUplink)  # the one registry line
