"""The DEFT uplink method: who selects where, each round.

Server (:class:`DeftUplink`, one instance per run): before a train round it partitions the compressed tensors, sizes
each partition's k by norm (Algorithm 3) and bin-packs the partitions over the clients sampled for that round
(:func:`fedcomp.methods.deft.plan_round`), taken in the order the server's grid lists them
(partition order under :class:`~fedcomp.flower.sampling.SeededSampling`, so one seed gives one
run). Each client gets its own :class:`DeftAllocation` as protobuf bytes in the downlink record.
After decoding a reply it checks that the client selected only inside its partitions and no more
than their k: a client that sends more is rejected like any corrupt payload.

The norms (``deft-norms``): with ``"clients"`` (the default, the paper's) the allocation asks each
client for the L2 norm of every compressed tensor's accumulated update (its residual plus this
round's update: what it selects from), 4 bytes a tensor in the reply's uplink record
(``deft.norms``). The next round's k follow, per tensor, the median of the accepted replies'
norms: false norms only misplace k (never a value of the model), fewer than half of the replies
cannot move a median outside the honest ones' range, and a reply whose norms are malformed (wrong
count, not finite, negative) is rejected. A tensor split
into parts gives each part ``N * sqrt(part / tensor)`` (:func:`~fedcomp.methods.deft.plan_round`):
per-part norms would cost a value per part (thousands a reply for ResNet-50 over 100 clients).
With ``"aggregate"`` the server plans from its last aggregated update instead (no bytes, but the
aggregate holds only what was selected, so k drift toward the partitions that had large ones;
measured in :mod:`fedcomp.methods.deft`). Round 1, and any round after one in which no accepted
reply carried norms, plan by size or from the aggregate.

Client (:meth:`DeftUplink.client_codecs`): validates the allocation against its replica's shapes and encodes
every compressed tensor with :class:`~fedcomp.codecs.TopK` restricted to its partitions
(Algorithm 5); what it does not send stays in its residual (error feedback). An update that was
not aggregated goes back into that residual (the default ``client_recover``); the next rounds send
it inside whatever partitions the client is then allocated.

Tensors under ``min-compress-numel`` are not partitioned: every client sends them dense, as with
the other uplink codecs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedcomp.codecs import Codec, TensorSpec, TopK, get_codec
from fedcomp.errors import PayloadError
from fedcomp.methods.base import ClientRound, Decoded, SentTerm, UplinkMethod, extra_key, sent_positions
from fedcomp.methods.deft import check_allocation, check_selection, plan_round, plan_round_from_aggregate, ranges_for
from fedcomp.methods.statistics import sent_dense
from fedcomp.wire.payloads import DeftAllocation, EncodedUpdate
from fedcomp.wire.serde import allocation_from_bytes, allocation_to_bytes

if TYPE_CHECKING:
    from fedcomp.methods.config import CompressionConfig

Ranges = tuple[tuple[int, int, int], ...]


def _large(specs: Sequence[TensorSpec], min_numel: int) -> list[int]:
    """The tensors DEFT selects in (the others go dense: :func:`sent_dense`)."""
    return [i for i, s in enumerate(specs) if not sent_dense(s.name, s.numel, min_numel)]


class DeftUplink(UplinkMethod):
    """DEFT (Yoon and Oh, ICPP 2023): top-k inside partitions the server allocates so that no two
    clients select the same entries; k per partition from the clients' reported norms (or the last
    aggregate's, ``deft-norms``)."""

    method_id = "deft"
    reports_selection = True
    checks_sent = True  # (decode is the base decode, then check)
    #: Key of the allocation bytes in the downlink extras.
    ALLOCATION_KEY = extra_key("deft", "allocation")
    #: Key of a client's norms in its reply's uplink record.
    NORMS_KEY = extra_key("deft", "norms")

    def __init__(self, config: CompressionConfig, weighted_mean: bool = True) -> None:
        super().__init__(config, weighted_mean)
        self.min_numel = config.min_compress_numel
        self.aggregate: dict[str, torch.Tensor] | None = None  # the last aggregated update
        #: Per compressed tensor (model order), the median of the last aggregated round's reported norms.
        self.norms: list[float] | None = None
        self._reported: dict[int, np.ndarray] = {}  # this round's replies' norms, by node
        self._accepted: list[np.ndarray] = []  # those of replies that passed every check
        #: What the last plan sized k by: "clients", "aggregate" or "sizes" (results.json).
        self.planned_from = "sizes"
        #: The last plan's k per compressed tensor (its partitions' k summed), by name: also the
        #: tensors a reply's norms are for.
        self.planned_k: dict[str, int] = {}
        self._ranges: dict[int, list[Ranges]] = {}
        self.last_round: int | None = None

    def state_dict(self) -> dict[str, Any]:
        """As the base's, without one round's reports (a checkpoint is taken between rounds)."""
        return {k: v for k, v in super().state_dict().items() if k not in ("_reported", "_accepted")}

    @classmethod
    def summary(cls, config: CompressionConfig) -> str:
        by = "the clients' reported norms" if config.deft_norms == "clients" else "the last aggregate's norms"
        return f"{super().summary(config)} (p of all clients together; k by {by})"

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        """Plain top-k; each client's partitions come with its allocation."""
        return {"id": "topk", "p": config.topk_density.at(server_round)}

    # --- server ----------------------------------------------------------------------------------

    def downlink_extras(
        self, server_round: int, nodes: Sequence[int], specs: Sequence[TensorSpec]
    ) -> dict[int, dict[str, bytes]]:
        density = self.config.topk_density.at(server_round)
        return {n: {self.ALLOCATION_KEY: b} for n, b in self.plan(server_round, nodes, specs, density).items()}

    def plan(
        self, server_round: int, nodes: Sequence[int], specs: Sequence[TensorSpec], density: float
    ) -> dict[int, bytes]:
        """Allocation bytes for each node: the ``i``-th node of ``nodes`` is client ``i`` of the
        round (bin ``(round + i) % n``). The wrapper passes them in the order its grid lists them,
        which :class:`~fedcomp.flower.sampling.SeededSampling` makes partition order: the same
        partition gets the same bins in every run, whatever the node ids. (In node-id order, a
        simulation's new random ids gave each run's partitions other bins: DEFT runs with one
        seed ended on different models.)"""
        large = _large(specs, self.min_numel)
        self._ranges, self._reported, self._accepted = {}, {}, []
        self.planned_k = {specs[i].name: 0 for i in large}
        self.last_round = server_round
        if not nodes:
            return {}
        numels = [specs[i].numel for i in large]
        if self.norms is not None and len(self.norms) == len(large):
            allocations = plan_round(numels, self.norms, density, len(nodes), server_round)
            self.planned_from = "clients"
        elif self.aggregate is None:
            allocations = plan_round(numels, None, density, len(nodes), server_round)
            self.planned_from = "sizes"
        else:
            agg = [self.aggregate[specs[i].name] for i in large]
            allocations = plan_round_from_aggregate(agg, density, len(nodes), server_round)
            self.planned_from = "aggregate"
        report = self.config.deft_norms == "clients"
        for alloc in allocations:
            for p in alloc.partitions:
                self.planned_k[specs[large[p.tensor]].name] += p.k
        out: dict[int, bytes] = {}
        for node, alloc in zip(nodes, allocations, strict=True):
            # plan_round numbers the compressed tensors; the wire numbers the model's tensors.
            partitions = tuple(replace(p, tensor=large[p.tensor]) for p in alloc.partitions)
            full = DeftAllocation(alloc.round, partitions, report_norms=report)
            self._ranges[node] = ranges_for(full, len(specs))
            out[node] = allocation_to_bytes(full)
        return out

    def decode(
        self,
        update: EncodedUpdate,
        specs: Sequence[TensorSpec],
        model: Mapping[str, torch.Tensor],
        server_round: int,
        node: int,
    ) -> Decoded:
        decoded = super().decode(update, specs, model, server_round, node)
        assert decoded.delta is not None
        self.check(node, decoded.delta, specs)
        return decoded

    def check(self, node: int, delta: Mapping[str, SentTerm], specs: Sequence[TensorSpec]) -> None:
        """Raise :class:`PayloadError` when ``node`` sent entries outside its allocation. Each
        tensor dense (its non-zeros are checked) or as positions and values (the positions of the
        non-zero values: the same ones)."""
        ranges = self._ranges.get(node)
        if ranges is None:
            raise PayloadError("", f"node {node} had no DEFT allocation this round")
        for i in _large(specs, self.min_numel):
            check_selection(sent_positions(delta[specs[i].name]), ranges[i], specs[i].name)

    def check_sent(self, node: int, delta: Mapping[str, SentTerm], specs: Sequence[TensorSpec]) -> None:
        self.check(node, delta, specs)

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        return {"deft_k_from": self.planned_from, "deft_k": dict(self.planned_k)}

    def note_extras(self, server_round: int, node: int, extras: Mapping[str, bytes]) -> None:
        """Read ``node``'s norms (kept once :meth:`accept` takes the reply); raise
        :class:`PayloadError` when they are not one finite, non-negative float32 per compressed
        tensor. A reply without them (a client that does not know the field) is planned around."""
        data = extras.get(self.NORMS_KEY)
        if data is None or self.config.deft_norms != "clients":
            return
        n = len(self.planned_k)
        if len(data) != 4 * n:
            raise PayloadError(
                "",
                f"uplink: field {self.NORMS_KEY!r} has {len(data)} bytes, expected {4 * n} "
                f"(a float32 for each of the {n} compressed tensors)",
            )
        norms = np.frombuffer(data, dtype="<f4").astype(np.float64)
        if not (np.isfinite(norms).all() and (norms >= 0).all()):
            raise PayloadError("", f"uplink: field {self.NORMS_KEY!r} holds a norm that is not finite or is negative")
        self._reported[node] = norms

    def accept(self, server_round: int, node: int) -> None:
        norms = self._reported.pop(node, None)
        if norms is not None:
            self._accepted.append(norms)

    def finish(
        self, server_round: int, aggregated: Mapping[str, torch.Tensor], model: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        if self._accepted:
            # The lower median per tensor: one client's report cannot set it.
            stacked = np.sort(np.stack(self._accepted), axis=0)
            self.norms = [float(v) for v in stacked[(len(stacked) - 1) // 2]]
            self.aggregate = None
        else:
            self.norms = None
            self.observe({k: aggregated[k] - model[k] for k in model})
        self._accepted = []
        return None

    def observe(self, aggregate_delta: Mapping[str, torch.Tensor]) -> None:
        """Remember the aggregated update: the next allocation's k follow its partitions' norms."""
        self.aggregate = {k: v.detach().float() for k, v in aggregate_delta.items()}

    # --- client ----------------------------------------------------------------------------------

    @classmethod
    def client_extras(
        cls, rnd: ClientRound, residual: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor]
    ) -> dict[str, bytes]:
        """The L2 norm of each compressed tensor's accumulated update (``residual + update``,
        what top-k selected from), float32 in model order, when the allocation asks for them."""
        data = rnd.extras.get(cls.ALLOCATION_KEY)
        if data is None or not allocation_from_bytes(data).report_norms:
            return {}
        norms = []
        for name, t in rnd.replica.items():
            if sent_dense(name, t.numel(), rnd.min_numel):
                continue
            acc = update[name] if name not in residual else residual[name] + update[name]
            acc = acc.detach() if acc.is_floating_point() else acc.detach().double()
            norms.append(torch.linalg.vector_norm(acc, dtype=torch.float64))
        if not norms:
            return {}
        # (one copy to the host; a norm past float32's range is sent as its largest value)
        values = np.minimum(torch.stack(norms).cpu().numpy(), np.finfo(np.float32).max).astype("<f4")
        return {cls.NORMS_KEY: values.tobytes()}

    @classmethod
    def client_codecs(cls, rnd: ClientRound) -> tuple[Codec, dict[str, Codec] | None]:
        data = rnd.extras.get(cls.ALLOCATION_KEY)
        if data is None:
            raise PayloadError("", "a DEFT round came without this client's allocation")
        overrides = client_codecs(data, rnd.replica, rnd.min_numel, rnd.server_round)
        return get_codec(rnd.codec_config), overrides


def client_codecs(
    data: bytes, replica: Mapping[str, torch.Tensor], min_numel: int, server_round: int | None = None
) -> dict[str, Codec]:
    """The per-tensor codecs a client encodes with under the allocation ``data`` (validated)."""
    alloc = allocation_from_bytes(data)
    numels = [t.numel() for t in replica.values()]
    check_allocation(alloc, numels, expected_round=server_round)
    ranges = ranges_for(alloc, len(numels))
    return {
        name: TopK(ranges=r)
        for (name, t), r in zip(replica.items(), ranges, strict=True)
        if not sent_dense(name, t.numel(), min_numel)
    }
