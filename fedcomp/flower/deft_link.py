"""DEFT through the strategy wrapper and the client mod: who selects where, each round.

Server (:class:`DeftPlanner`): before a train round it partitions the compressed tensors, sizes
each partition's k from the L2 norm of that partition in the previous round's aggregated update
(the server has that aggregate; norms reported by the clients would cost uplink bytes; in the
first round k is proportional to size) and bin-packs the partitions over the clients sampled for that round
(:func:`fedcomp.methods.deft.plan_round`). Each client gets its own :class:`DeftAllocation` as protobuf
bytes in the downlink record. After decoding a reply it checks that the client selected only
inside its partitions and no more than their k: a client that sends more is rejected like any
corrupt payload.

Client (:func:`client_codecs`): validates the allocation against its replica's shapes and encodes
every compressed tensor with :class:`~fedcomp.codecs.TopK` restricted to its partitions
(Algorithm 5); what it does not send stays in its residual (error feedback).

Tensors under ``min-compress-numel`` are not partitioned: every client sends them dense, as with
the other uplink codecs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from fedcomp.codecs import Codec, TensorSpec, TopK
from fedcomp.errors import PayloadError
from fedcomp.methods.deft import (
    check_allocation,
    check_selection,
    plan_round,
    plan_round_from_aggregate,
    ranges_for,
)
from fedcomp.wire.payloads import DeftAllocation
from fedcomp.wire.serde import allocation_from_bytes, allocation_to_bytes

#: Key of the allocation bytes in the downlink ConfigRecord.
ALLOCATION_KEY = "deft-allocation"

Ranges = tuple[tuple[int, int, int], ...]


def _large(specs: Sequence[TensorSpec], min_numel: int) -> list[int]:
    return [i for i, s in enumerate(specs) if s.numel >= min_numel]


class DeftPlanner:
    """Server side: one allocation per round, remembered per node until its reply is checked."""

    def __init__(self, min_numel: int) -> None:
        self.min_numel = min_numel
        self.aggregate: dict[str, torch.Tensor] | None = None  # the last aggregated update
        self._ranges: dict[int, list[Ranges]] = {}
        self.last_round: int | None = None

    def plan(
        self, server_round: int, nodes: Sequence[int], specs: Sequence[TensorSpec], density: float
    ) -> dict[int, bytes]:
        """Allocation bytes for each node (sorted node ids get the bins in order)."""
        large = _large(specs, self.min_numel)
        self._ranges = {}
        self.last_round = server_round
        if not nodes:
            return {}
        if self.aggregate is None:
            allocations = plan_round([specs[i].numel for i in large], None, density, len(nodes), server_round)
        else:
            agg = [self.aggregate[specs[i].name] for i in large]
            allocations = plan_round_from_aggregate(agg, density, len(nodes), server_round)
        out: dict[int, bytes] = {}
        for node, alloc in zip(sorted(nodes), allocations, strict=True):
            # plan_round numbers the compressed tensors; the wire numbers the model's tensors.
            full = DeftAllocation(alloc.round, tuple(replace(p, tensor=large[p.tensor]) for p in alloc.partitions))
            self._ranges[node] = ranges_for(full, len(specs))
            out[node] = allocation_to_bytes(full)
        return out

    def check(self, node: int, delta: Mapping[str, torch.Tensor], specs: Sequence[TensorSpec]) -> None:
        """Raise :class:`PayloadError` when ``node`` sent entries outside its allocation."""
        ranges = self._ranges.get(node)
        if ranges is None:
            raise PayloadError("", f"node {node} had no DEFT allocation this round")
        for i in _large(specs, self.min_numel):
            check_selection(delta[specs[i].name].reshape(-1), ranges[i], specs[i].name)

    def observe(self, aggregate_delta: Mapping[str, torch.Tensor]) -> None:
        """Remember the aggregated update: the next allocation's k follow its partitions' norms."""
        self.aggregate = {k: v.detach().float() for k, v in aggregate_delta.items()}


def client_codecs(
    data: bytes, replica: Mapping[str, torch.Tensor], min_numel: int, server_round: int | None = None
) -> dict[str, Codec]:
    """The per-tensor codecs a client encodes with under the allocation ``data`` (validated)."""
    alloc = allocation_from_bytes(data)
    numels = [t.numel() for t in replica.values()]
    check_allocation(alloc, numels, expected_round=server_round)
    ranges = ranges_for(alloc, len(numels))
    return {
        name: TopK(ranges=r) for (name, t), r in zip(replica.items(), ranges, strict=True) if t.numel() >= min_numel
    }
