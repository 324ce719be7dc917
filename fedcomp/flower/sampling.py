"""Reproducible client sampling: one seed picks the same partitions in every round of every run.

Flower's strategies sample clients with ``random.sample`` over ``grid.get_node_ids()``. Two things
make that differ between runs with one seed: a simulation's node ids are new random numbers in
every run (and a deployment's differ by host), and Flower itself draws from the global ``random``
at times that depend on timing (jittered back-offs and heartbeats), so a seed set once at the
start leaves round 2's sample to chance (measured on the reference app: with the nodes listed in
partition order and the seed set once, two runs sampled the same partitions in round 1 only).

* :class:`SeededSampling` wraps any strategy: it asks each node once which partition it trains on
  (a ``query.fedcomp_partition`` message, answered by :func:`answer_partition_query` from the node
  config's ``partition-id``), lists the nodes to the inner strategy in partition order (nodes that
  did not answer last, by id), and seeds ``random`` from (``seed``, round, phase) right before
  each configure call.
* :func:`add_partition_query` registers the client side on a ClientApp (a query handler of its
  own name: a ClientApp's own ``query`` handler stays as it is; Flower routes a message to a
  registered handler before any mod runs, so this cannot be a mod).

The dense baseline wrapped the same way samples the same partitions as the compressed run, so a
comparison at one seed trains the same clients each round. Not covered: a thread other than the
strategy's that draws from ``random`` between the seeding and the sample (microseconds apart in
the same call).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedcomp.flower.grids import DelegatingGrid

__all__ = [
    "PARTITION_QUERY",
    "PARTITION_RECORD",
    "SeededSampling",
    "add_partition_query",
    "answer_partition_query",
    "query_partitions",
]

log = logging.getLogger("flwr").getChild("fedcomp")

#: The action of the query message that asks a node its partition (``query.<action>``).
PARTITION_ACTION = "fedcomp_partition"
PARTITION_QUERY = f"{MessageType.QUERY}.{PARTITION_ACTION}"
#: The reply's MetricRecord, holding ``partition-id``.
PARTITION_RECORD = "fedcomp.partition"


def answer_partition_query(msg: Message, context: Context) -> Message:
    """The ClientApp's answer to :func:`query_partitions`: this node's ``partition-id`` (none when
    its node config has no integer one)."""
    pid = context.node_config.get("partition-id")
    content = RecordDict()
    if isinstance(pid, int) and not isinstance(pid, bool):
        content[PARTITION_RECORD] = MetricRecord({"partition-id": pid})
    return Message(content=content, reply_to=msg)


def add_partition_query(app: ClientApp) -> ClientApp:
    """Register :func:`answer_partition_query` on ``app`` (as ``query.fedcomp_partition``), so
    that a server wrapped in :class:`SeededSampling` learns which partition this node holds."""
    app.query(PARTITION_ACTION)(answer_partition_query)
    return app


def query_partitions(grid: Grid, nodes: Iterable[int], timeout_s: float = 60.0) -> dict[int, int]:
    """Ask ``nodes`` (one query message each, no payload) for their ``partition-id``: node id ->
    partition id, for the nodes that answered with an int within ``timeout_s``. A node whose
    ClientApp lacks :func:`add_partition_query`, or without ``partition-id`` in its node config, is
    left out (its reply is an error, or empty)."""
    messages = [Message(RecordDict(), dst_node_id=n, message_type=PARTITION_QUERY) for n in nodes]
    order: dict[int, int] = {}
    if not messages:
        return order
    for reply in grid.send_and_receive(messages, timeout=timeout_s):
        if reply.has_error() or PARTITION_RECORD not in reply.content.metric_records:
            continue
        pid = reply.content.metric_records[PARTITION_RECORD].get("partition-id")
        if isinstance(pid, int) and not isinstance(pid, bool):
            order[reply.metadata.src_node_id] = pid
    return order


class _InPartitionOrder(DelegatingGrid):
    """``grid`` whose :meth:`get_node_ids` lists the nodes by partition id (unknown ones last, by
    id)."""

    def __init__(self, grid: Grid, order: dict[int, int]) -> None:
        super().__init__(grid)
        self._order = order

    def get_node_ids(self) -> Iterable[int]:
        ids = list(self._grid.get_node_ids())
        return sorted(ids, key=lambda n: (0, self._order[n], n) if n in self._order else (1, 0, n))


class SeededSampling(Strategy):
    """``strategy`` with reproducible sampling (see the module docstring): before each configure
    call, the nodes not asked yet are asked their partition, and ``random`` is seeded from
    (``seed``, round, phase). The inner strategy sees every round and reply as they are.

    :attr:`partitions` holds the answers (node id -> partition id), e.g. for a results file."""

    def __init__(self, strategy: Strategy, seed: int, query_timeout_s: float = 60.0) -> None:
        self.strategy, self.seed, self.query_timeout_s = strategy, seed, query_timeout_s
        self.partitions: dict[int, int] = {}
        self._asked: set[int] = set()

    def _prepared(self, grid: Grid, server_round: int, phase: str) -> Grid:
        new = [n for n in grid.get_node_ids() if n not in self._asked]
        if new:
            self._asked.update(new)
            self.partitions.update(query_partitions(grid, new, self.query_timeout_s))
            log.info("fedcomp: partition ids known for %s of %s nodes", len(self.partitions), len(self._asked))
        random.seed(f"fedcomp-sampling:{self.seed}:{server_round}:{phase}")
        return _InPartitionOrder(grid, self.partitions)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        grid = self._prepared(grid, server_round, "train")
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        grid = self._prepared(grid, server_round, "evaluate")
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        log.info(
            "fedcomp: %s, each round's client sampling seeded from seed %s", type(self.strategy).__name__, self.seed
        )
        self.strategy.summary()
