"""Codecs, looked up by id from an explicit allow-list (no registration on import)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedcomp.codecs.base import Codec, TensorSpec
from fedcomp.codecs.dense import DenseFP16, DenseFP32, Identity
from fedcomp.codecs.gradiveq import GradiVeQ
from fedcomp.codecs.lattice import Lattice
from fedcomp.codecs.sbc import SBC
from fedcomp.codecs.sparse import Sparse
from fedcomp.codecs.stc import STC
from fedcomp.codecs.threelc import ThreeLC
from fedcomp.codecs.topk import TopK
from fedcomp.errors import ConfigError

__all__ = [
    "CODECS",
    "SBC",
    "STC",
    "Codec",
    "DenseFP16",
    "DenseFP32",
    "GradiVeQ",
    "Identity",
    "Lattice",
    "Sparse",
    "TensorSpec",
    "ThreeLC",
    "TopK",
    "get_codec",
]

#: Every codec a config may name, by ``codec_id``.
CODECS: dict[str, type[Codec]] = {
    c.codec_id: c for c in (SBC, STC, ThreeLC, TopK, DenseFP32, DenseFP16, Identity, GradiVeQ, Lattice, Sparse)
}


def get_codec(config: dict[str, Any] | str) -> Codec:
    """Build a codec from its config (``{"id": ..., **params}``) or bare id."""
    if not isinstance(config, str | Mapping):
        raise ConfigError(f"codec config: a codec id or a mapping with 'id' is needed, got {config!r}")
    cfg: dict[str, Any] = {"id": config} if isinstance(config, str) else dict(config)
    cid = cfg.get("id")
    if cid not in CODECS:
        raise ConfigError(f"id: unknown codec {cid!r}; known: {sorted(CODECS)}")
    return CODECS[cid].from_config(cfg)
