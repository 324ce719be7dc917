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
from fedcomp.flower.protocol import DOWNLINK, UPLINK, DownlinkMode

__all__ = [
    "MeteredGrid",
    "array_nbytes",
    "arrayrecord_nbytes",
    "centralized_evaluate_fn",
    "message_nbytes",
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


def message_nbytes(m: Message) -> int:
    """Bytes Flower moves for ``m``: its objects (the message, its records, the arrays' chunks),
    each deflated, as Flower 1.41's transport pushes and pulls them; where that API is missing,
    the message's protobuf size. Everything counts: the payload, fedcomp's header fields, the
    config record, Flower's metadata and object ids.

    It serialises the message once more than Flower does (measured: 0.35 ms for a 30 kB compressed
    message, 3.5 ms for a dense LeNet5-Caffe one, 204 ms for a 100 MB one): the reference app's
    meter, not the library's (the wrapper's ``fedcomp.*`` figures count payloads, for free)."""
    try:
        from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    except ImportError:  # (another Flower)
        from flwr.common.serde import message_to_proto

        return int(message_to_proto(m).ByteSize())
    return sum(len(o.deflate()) for o in get_all_nested_objects(m).values())


class MeteredGrid(DelegatingGrid):
    """A ``Grid`` that reports each message's size to ``recorder``, then delegates.

    Outgoing messages count as downlink to ``dst_node_id``, replies as uplink from
    ``src_node_id``, each whole (:func:`message_nbytes`: the bytes that cross the wire, headers
    included; error replies too, since they cross it as well). Queries are no round's traffic and
    count nothing (:class:`~fedcomp.flower.sampling.SeededSampling` asks each node its partition
    once a run: about 160 B each way). It counted payload
    bytes only (the arrays and the ``bytes`` fields) until an audit found that this left about
    1 kB a downlink and 0.5 kB an uplink out, and overstated the compression factors by 8 % (the
    default run's downlink) to 53 % (``sbc-p = 0.001``).

    ``dense_nbytes`` is the fp32 model's size: what a dense FedAvg message carries. It is added as
    ``dense_*`` for every message that stands for a model (:func:`_stands_for_model`), so the
    factors compare the same rounds, clients and messages with dense FedAvg; dense FedAvg's own
    headers (4.2 kB a LeNet5-Caffe downlink, measured: metadata, object ids, the config) are left
    out of it, in dense FedAvg's favour. Traffic
    goes to the recorder's current round, i.e. the round that the next ``end_round`` closes.
    """

    def __init__(
        self,
        grid: Grid,
        recorder: RunRecorder,
        dense_nbytes: int,
        measure: Callable[[Message], int] = message_nbytes,
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
            self._recorder.add_traffic(
                m.metadata.dst_node_id,
                downlink_bytes=self._measure(m),
                dense_downlink_bytes=self._dense if _stands_for_model(m) else 0,
            )
        return messages

    def _in(self, replies: Iterable[Message]) -> list[Message]:
        replies = list(replies)
        for m in replies:
            if _is_query(m):
                continue
            self._recorder.add_traffic(
                m.metadata.src_node_id,
                uplink_bytes=self._measure(m),
                dense_uplink_bytes=self._dense if _stands_for_model(m) else 0,
            )
        return replies

    # (measured once pushed: the push gives a message its id, which crosses the wire too)
    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        ids = list(self._grid.push_messages(messages))
        self._out(messages)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._in(self._grid.pull_messages(message_ids))

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        replies = self._grid.send_and_receive(messages, timeout=timeout)
        self._out(messages)
        return self._in(replies)


def _stands_for_model(m: Message) -> bool:
    """Whether dense FedAvg's message in ``m``'s place would carry the fp32 model: a train or
    evaluate downlink (fedcomp's, or an ArrayRecord), a train reply with an update; not a
    query, an error reply, an evaluate reply (metrics), nor the downlink that tells a client to
    build the seeded initial model itself (mode ``none`` at version 0: dense FedAvg seeded the
    same way sends nothing, and DEFT's round-1 allocation, which that message may carry, has no
    dense counterpart; it was charged a whole dense model, which made DEFT's downlink factor about
    1/rounds too good)."""
    if m.has_error() or not m.has_content():
        return False
    down = m.content.config_records.get(DOWNLINK)
    if down is not None:
        return not (down.get("mode") == DownlinkMode.NONE and down.get("version") == 0)
    return bool(m.content.array_records) or UPLINK in m.content.config_records


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
