"""The ``lattice`` downlink method: a replica on a power-of-two grid, so that catch-ups merge exactly.

A departure from 3LC (the reference downlink), for partial participation: a client that missed
rounds gets one merged payload (the net change of the grid point since its version) instead of
the chain of per-round deltas, bit-identical to the chain and still digest-verified. The server
side lives in :mod:`fedcomp.flower.replica` (``ServerReplica`` with a
:class:`~fedcomp.codecs.lattice.Lattice` codec), the codec in :mod:`fedcomp.codecs.lattice`.
Measured against 3LC in docs/compression_gap.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedcomp.methods.base import DownlinkMethod

if TYPE_CHECKING:
    from fedcomp.methods.config import CompressionConfig

__all__ = ["LatticeDownlink"]


class LatticeDownlink(DownlinkMethod):
    """Lattice replica: per-tensor grid ``2**floor(log2(min(lattice-step * RMS(first movement),
    lattice-weight-step * RMS(values))))``."""

    method_id = "lattice"

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        return {"id": "lattice", "step": config.lattice_step, "weight_step": config.lattice_weight_step}
