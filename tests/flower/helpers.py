"""Shared pieces of the Flower-layer tests: a tiny model, a fixed Grid, clients that run the real
:func:`compression_mod` around a deterministic fake training, and one in-process round driver
(server messages -> mod -> replies -> ``aggregate_train``). No ``flwr run``, no network.

Only public entry points are used: ``CompressionStrategy``, ``compression_mod``, the records in
``fedcomp.flower.protocol`` and the codec/wire helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedcomp.codecs import DenseFP32
from fedcomp.flower import protocol
from fedcomp.flower.mod import compression_mod
from fedcomp.flower.records import record_from_tensors, tensors_from_record
from fedcomp.flower.settings import CompressionConfig
from fedcomp.flower.strategy import CompressionStrategy
from fedcomp.methods.update import decode_update, specs_of
from fedcomp.wire.serde import update_from_bytes

#: FedAvg's default record names (the wrapper and the mod follow the inner strategy's).
ARRAYS = "arrays"
METRICS = "metrics"
MIN_NUMEL = 1000  # the default ``min-compress-numel``
#: An inner strategy's arguments that sample every node, for training and evaluation alike.
SAMPLE_ALL = {"fraction_train": 1.0, "fraction_evaluate": 1.0, "min_train_nodes": 1, "min_available_nodes": 1}


@pytest.fixture(autouse=True)
def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a Flower process has set before any Message is built (Flower >= 1.2x asks for it)."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)


# --- model and training -----------------------------------------------------------------------


def tiny_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two tensors large enough to be compressed and one bias below ``min-compress-numel``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(40, 50, generator=g) * 0.1,
        "w2": torch.randn(1200, generator=g) * 0.1,
        "b": torch.randn(10, generator=g) * 0.1,
    }


def n_params(model: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in model.values())


def local_delta(node: int, rnd: int, like: Mapping[str, torch.Tensor], scale: float = 0.01) -> dict[str, torch.Tensor]:
    """The known update node ``node`` makes in round ``rnd`` (deterministic)."""
    g = torch.Generator().manual_seed(100_003 * node + rnd)
    return {k: torch.randn(v.shape, generator=g) * scale for k, v in like.items()}


def num_examples(node: int) -> int:
    return 10 + node  # unequal weights: FedAvg's weighted mean is exercised


def context(node: int) -> Context:
    """A client's Context, built as Flower builds it."""
    return Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})


class FixedGrid(Grid):
    """A Grid that only knows which nodes are connected (set ``nodes`` before each round)."""

    def __init__(self, nodes: Iterable[int]) -> None:
        self.nodes = list(nodes)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def set_run(self, run_id: Any) -> None:  # pragma: no cover - unused
        raise NotImplementedError

    @property
    def run(self) -> Any:  # pragma: no cover - unused
        raise NotImplementedError

    def create_message(self, *args: Any, **kwargs: Any) -> Message:  # pragma: no cover - unused
        raise NotImplementedError

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # pragma: no cover
        raise NotImplementedError

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # pragma: no cover
        raise NotImplementedError

    def send_and_receive(self, *args: Any, **kwargs: Any) -> Iterable[Message]:  # pragma: no cover
        raise NotImplementedError


def make_strategy(**run_config: Any) -> CompressionStrategy:
    """``CompressionStrategy(FedAvg)`` that samples every connected node, with kebab-case keys."""
    inner = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=1.0,
        min_train_nodes=1,
        min_evaluate_nodes=1,
        min_available_nodes=1,
    )
    return CompressionStrategy(inner, CompressionConfig.from_run_config(run_config))


# --- clients ----------------------------------------------------------------------------------


@dataclass
class Client:
    """One client node: a real Context and ``compression_mod`` around a fake ClientApp whose
    training adds ``local_delta(node, round)`` to the model it was given."""

    node: int
    ctx: Context = field(init=False)
    #: round -> (model received from the mod, delta it trained)
    seen: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = field(default_factory=dict)
    calls: int = 0

    def __post_init__(self) -> None:
        self.ctx = context(self.node)

    def app(self, msg: Message, ctx: Context) -> Message:
        self.calls += 1
        received = tensors_from_record(msg.content.array_records[ARRAYS])
        config = msg.content.config_records.get(protocol.CONFIG_RECORD)
        rnd = int(config[protocol.SERVER_ROUND]) if config is not None else -1  # type: ignore[arg-type]
        if msg.metadata.message_type == MessageType.TRAIN:
            d = local_delta(self.node, rnd, received)
            self.seen[rnd] = (received, d)
            trained = self.replied(received, {k: received[k] + d[k] for k in received})
            content = RecordDict(
                {ARRAYS: record_from_tensors(trained), METRICS: MetricRecord({"num-examples": num_examples(self.node)})}
            )
        else:
            self.seen[rnd] = (received, {})
            loss = float(sum(float(t.abs().sum()) for t in received.values()))
            content = RecordDict({METRICS: MetricRecord({"num-examples": num_examples(self.node), "loss": loss})})
        return Message(content, reply_to=msg)

    def replied(self, received: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The arrays this client replies after training from ``received`` (a subclass changes some:
        a frozen layer, a counter)."""
        return trained

    def handle(self, msg: Message) -> Message:
        return compression_mod(msg, self.ctx, self.app)


# --- records --------------------------------------------------------------------------------


def downlink_of(msg: Message) -> ConfigRecord:
    return msg.content.config_records[protocol.DOWNLINK]


def uplink_of(msg: Message) -> ConfigRecord:
    return msg.content.config_records[protocol.UPLINK]


def record_bytes(rec: Mapping[str, Any]) -> int:
    """Every byte value a record carries (the payload list and any method extras)."""
    n = 0
    for v in rec.values():
        if isinstance(v, bytes):
            n += len(v)
        elif isinstance(v, list):
            n += sum(len(x) for x in v if isinstance(x, bytes))
    return n


def extras_bytes(rec: Mapping[str, Any]) -> int:
    """Bytes of the method extras only (top-level byte values, not the payload list)."""
    return sum(len(v) for v in rec.values() if isinstance(v, bytes))


def payloads_of(rec: Mapping[str, Any]) -> list[bytes]:
    """The downlink payloads, with the field name ``DownlinkHeader.to_record`` writes."""
    return list(rec["payloads"])


def mode_of(rec: Mapping[str, Any]) -> str:
    return str(rec["mode"])


def with_fields(rec: Mapping[str, Any], drop: Iterable[str] = (), **changes: Any) -> ConfigRecord:
    """A copy of ``rec`` with fields replaced (``replica_version`` -> ``replica-version``)."""
    out = {k: v for k, v in rec.items() if k not in set(drop)}
    out.update({k.replace("_", "-"): v for k, v in changes.items()})
    return ConfigRecord(out)


def decode_payload(data: bytes, model: Mapping[str, torch.Tensor], codec: Any) -> dict[str, torch.Tensor]:
    """Decode an uplink payload as the server would (``codec`` for large tensors, dense else)."""
    return decode_update(update_from_bytes(data), specs_of(model), [codec, DenseFP32()])


# --- one round in process -----------------------------------------------------------------------


@dataclass
class RoundLog:
    """What crossed the wire in one round, captured before the strategy consumed it."""

    downlinks: dict[int, ConfigRecord] = field(default_factory=dict)
    replies: dict[int, Message] = field(default_factory=dict)
    uplinks: dict[int, ConfigRecord] = field(default_factory=dict)


def train_round(
    strategy: CompressionStrategy,
    clients: Mapping[int, Client],
    rnd: int,
    model: Mapping[str, torch.Tensor],
    nodes: Iterable[int] | None = None,
    tamper: Callable[[int, Message], Message] | None = None,
    drop: Iterable[int] = (),
) -> tuple[dict[str, torch.Tensor] | None, RoundLog]:
    """configure_train -> mod on each sampled node -> (tamper) -> aggregate_train. The replies of
    the nodes in ``drop`` never arrive (the client ran and replied; the server does not see it)."""
    dropped = set(drop)
    grid = FixedGrid(sorted(clients) if nodes is None else nodes)
    log = RoundLog()
    msgs = list(strategy.configure_train(rnd, record_from_tensors(model), ConfigRecord({"lr": 0.1}), grid))
    replies = []
    for msg in msgs:
        node = msg.metadata.dst_node_id
        log.downlinks[node] = ConfigRecord(dict(downlink_of(msg)))
        reply = clients[node].handle(msg)
        if tamper is not None:
            reply = tamper(node, reply)
        log.replies[node] = reply
        if reply.has_content() and protocol.UPLINK in reply.content.config_records:
            log.uplinks[node] = ConfigRecord(dict(uplink_of(reply)))
        if node not in dropped:
            replies.append(reply)
    arrays, _ = strategy.aggregate_train(rnd, replies)
    return (tensors_from_record(arrays) if arrays is not None else None), log


def evaluate_round(
    strategy: CompressionStrategy,
    clients: Mapping[int, Client],
    rnd: int,
    model: Mapping[str, torch.Tensor],
    nodes: Iterable[int] | None = None,
) -> tuple[Any, RoundLog]:
    grid = FixedGrid(sorted(clients) if nodes is None else nodes)
    log = RoundLog()
    msgs = list(strategy.configure_evaluate(rnd, record_from_tensors(model), ConfigRecord({}), grid))
    replies = []
    for msg in msgs:
        node = msg.metadata.dst_node_id
        log.downlinks[node] = ConfigRecord(dict(downlink_of(msg)))
        reply = clients[node].handle(msg)
        log.replies[node] = reply
        replies.append(reply)
    return strategy.aggregate_evaluate(rnd, replies), log


def weighted_mean(deltas: Mapping[int, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    total = sum(num_examples(n) for n in deltas)
    names = next(iter(deltas.values())).keys()
    return {k: sum(num_examples(n) * d[k] for n, d in deltas.items()) / total for k in names}


def max_abs_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)
