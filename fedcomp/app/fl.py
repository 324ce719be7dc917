"""Flower glue that does not depend on compression: traffic metering and centralized evaluation.

* :class:`MeteredGrid` wraps the ServerApp's ``Grid`` and reports, for every message that goes
  out and every reply that comes back, its payload size to a :class:`~fedcomp.app.results.RunRecorder`
  (per client: ``downlink_bytes`` / ``uplink_bytes`` as measured, ``dense_*`` = the fp32 model
  size). Because it sits between the strategy and the wire, it measures what a compressing
  strategy wrapper actually sends, whatever that wrapper does; pass ``measure=`` to count
  differently.
* :func:`centralized_evaluate_fn` makes the ``evaluate_fn`` for ``Strategy.start``: it evaluates
  the global model on the test set and closes the round in the recorder.
* :func:`recording_train_metrics_aggr` makes a ``train_metrics_aggr_fn`` that also records the
  clients' aggregated training metrics (``train_loss``) in the round's entry.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedcomp.app.models import evaluate
from fedcomp.app.results import RunRecorder
from fedcomp.errors import ConfigError
from fedcomp.flower.grids import DelegatingGrid
from fedcomp.flower.protocol import DOWNLINK, DownlinkMode

__all__ = [
    "MeteredGrid",
    "array_nbytes",
    "arrayrecord_nbytes",
    "centralized_evaluate_fn",
    "payload_nbytes",
    "recording_train_metrics_aggr",
    "wait_for_nodes",
]


def array_nbytes(array: Any) -> int:
    """Raw bytes of one ``flwr.app.Array``'s values (numel x itemsize, no serialization header)."""
    try:
        return math.prod(array.shape) * np.dtype(array.dtype).itemsize
    except TypeError:  # a dtype numpy does not know: fall back to the serialized size
        return len(array.data)


def arrayrecord_nbytes(record: ArrayRecord) -> int:
    """Raw bytes of all arrays in an ``ArrayRecord`` (an fp32 model: 4 x #params)."""
    return sum(array_nbytes(a) for a in record.values())


def payload_nbytes(content: RecordDict) -> int:
    """Payload bytes of a message: all ArrayRecord values plus ``bytes`` values in ConfigRecords.

    Scalars (round number, learning rate, metrics) are not counted: they are protocol
    chatter, not model traffic.
    """
    n = sum(arrayrecord_nbytes(r) for r in content.array_records.values())
    for record in content.config_records.values():
        for value in record.values():
            if isinstance(value, bytes):
                n += len(value)
            elif isinstance(value, list):
                n += sum(len(v) for v in value if isinstance(v, bytes))
    return n


class MeteredGrid(DelegatingGrid):
    """A ``Grid`` that reports each message's payload size to ``recorder``, then delegates.

    Outgoing messages count as downlink to ``dst_node_id``, replies as uplink from
    ``src_node_id`` (replies that carry an error count nothing). ``dense_nbytes`` is the
    uncompressed fp32 size of what each message stands for (the model); it is added as
    ``dense_*`` for every message that carries a payload, but a downlink that says its client is
    up to date (:func:`_up_to_date`). Traffic goes to the recorder's
    current round, i.e. the round that the next ``end_round`` closes. Query messages (e.g.
    :class:`~fedcomp.flower.sampling.SeededSampling` asking the nodes their partition) are not a
    round's traffic and count nothing.
    """

    def __init__(
        self,
        grid: Grid,
        recorder: RunRecorder,
        dense_nbytes: int,
        measure: Callable[[RecordDict], int] = payload_nbytes,
    ) -> None:
        super().__init__(grid)
        self._recorder = recorder
        self._dense = int(dense_nbytes)
        self._measure = measure

    # --- metering -----------------------------------------------------------------------------

    def _out(self, messages: Iterable[Message]) -> list[Message]:
        messages = list(messages)
        for m in messages:
            if _is_query(m):
                continue
            n = self._measure(m.content)
            self._recorder.add_traffic(
                m.metadata.dst_node_id,
                downlink_bytes=n,
                dense_downlink_bytes=self._dense if n and not _up_to_date(m) else 0,
            )
        return messages

    def _in(self, replies: Iterable[Message]) -> list[Message]:
        replies = list(replies)
        for m in replies:
            if m.has_error() or _is_query(m):
                continue
            n = self._measure(m.content)
            self._recorder.add_traffic(
                m.metadata.src_node_id,
                uplink_bytes=n,
                dense_uplink_bytes=self._dense if n else 0,
            )
        return replies

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(self._out(messages))

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._in(self._grid.pull_messages(message_ids))

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self._in(self._grid.send_and_receive(self._out(messages), timeout=timeout))


def _up_to_date(m: Message) -> bool:
    """Whether ``m`` tells its client it holds the model already (downlink mode ``none``): dense
    FedAvg would have sent nothing either, so whatever else it carries (DEFT's round-1 allocation)
    has no dense counterpart. It was charged a whole dense model, which made DEFT's downlink factor
    about 1/rounds too good."""
    rec = m.content.config_records.get(DOWNLINK)
    return rec is not None and rec.get("mode") == DownlinkMode.NONE


def _is_query(m: Message) -> bool:
    """Whether ``m`` is a query message (``query`` or ``query.<action>``), not a round's traffic."""
    return m.metadata.message_type.split(".")[0] == MessageType.QUERY


def wait_for_nodes(grid: Grid, n: int, timeout_s: float = 30.0, key: str = "clients-per-round") -> list[int]:
    """Wait until ``n`` nodes are connected; raise :class:`ConfigError` after ``timeout_s``.

    Flower's samplers wait forever for nodes that never come (e.g. asking for more clients per
    round than the simulation has SuperNodes); this turns that hang into an error naming ``key``.
    """
    deadline = time.monotonic() + timeout_s
    while len(nodes := list(grid.get_node_ids())) < n:
        if time.monotonic() > deadline:
            raise ConfigError(
                f"{key}: {n} clients needed but only {len(nodes)} SuperNodes are connected "
                f"after {timeout_s:.0f}s (simulation: raise num-supernodes)"
            )
        time.sleep(0.5)
    return nodes


def centralized_evaluate_fn(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    recorder: RunRecorder,
    device: str | torch.device = "cpu",
) -> Callable[[int, ArrayRecord], MetricRecord]:
    """``evaluate_fn(server_round, arrays)`` for ``Strategy.start``.

    Loads ``arrays`` into ``model``, evaluates on ``(x, y)``, closes the round in ``recorder``
    and returns ``MetricRecord({"accuracy", "loss"})``.
    """

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(model, x, y, device)
        recorder.end_round(server_round, accuracy=acc, loss=loss)
        return MetricRecord({"accuracy": acc, "loss": loss})

    return evaluate_fn


def recording_train_metrics_aggr(
    recorder: RunRecorder,
    aggregate: Callable[[list[RecordDict], str], MetricRecord] = aggregate_metricrecords,
) -> Callable[[list[RecordDict], str], MetricRecord]:
    """A ``train_metrics_aggr_fn`` for FedAvg & co. that also puts the aggregate in the recorder.

    Keys are recorded with ``-`` turned into ``_`` (``train-loss`` -> ``train_loss``);
    ``num-examples`` is recorded as the round's total, not its weighted mean.
    """

    def aggr(records: list[RecordDict], weighting_key: str) -> MetricRecord:
        out = aggregate(records, weighting_key)
        metrics = {k.replace("-", "_"): v for k, v in out.items() if k != weighting_key}
        total: float = 0
        for rd in records:
            for mr in rd.metric_records.values():
                if weighting_key in mr:
                    count = mr[weighting_key]
                    if not isinstance(count, (int, float)):  # Flower's aggregate() rejects these too
                        raise TypeError(f"metric {weighting_key!r}: expected a number, got {count!r}")
                    total += count
        metrics[weighting_key.replace("-", "_")] = total
        recorder.add_metrics(**metrics)
        return out

    return aggr
