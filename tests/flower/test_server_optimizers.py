"""Server optimizers through the wrapper: FedAvgM, FedAdam and FedYogi keep their own server step.

The wrapper hands the inner strategy full models (W + decoded update) and takes the model the
inner strategy returns as the next W. With lossless (identity) codecs both ways, a wrapped server
optimizer must therefore follow the plain one round by round; with SBC up and 3LC down it must
still take its own step (momentum / adaptive moments), not silently fall back to FedAvg.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM, FedYogi, Strategy

from fedcomp.flower.records import record_from_tensors, tensors_from_record
from fedcomp.flower.settings import CompressionConfig
from fedcomp.flower.strategy import CompressionStrategy
from tests.flower.helpers import (
    ARRAYS,
    METRICS,
    SAMPLE_ALL,
    Client,
    FixedGrid,
    local_delta,
    max_abs_diff,
    num_examples,
    server_identity,
    tiny_model,
    train_round,
)

__all__ = ["server_identity"]  # the autouse fixture, imported so it applies here

NODES = (1, 2, 3)
ROUNDS = 4

INNER: dict[str, Callable[[], Strategy]] = {
    "fedavgm": lambda: FedAvgM(server_momentum=0.9, server_learning_rate=1.0, **SAMPLE_ALL),
    "fedadam": lambda: FedAdam(eta=0.05, tau=1e-3, **SAMPLE_ALL),
    "fedyogi": lambda: FedYogi(eta=0.05, tau=1e-3, **SAMPLE_ALL),
}


def _plain(inner: Strategy) -> dict[str, torch.Tensor]:
    """``inner`` alone: each node replies with received + local_delta(node, round)."""
    model = tiny_model()
    for rnd in range(1, ROUNDS + 1):
        msgs = list(inner.configure_train(rnd, record_from_tensors(model), ConfigRecord({}), FixedGrid(NODES)))
        replies = []
        for msg in msgs:
            node = msg.metadata.dst_node_id
            received = tensors_from_record(msg.content.array_records[ARRAYS])
            d = local_delta(node, rnd, received)
            trained = {k: received[k] + d[k] for k in received}
            content = RecordDict(
                {ARRAYS: record_from_tensors(trained), METRICS: MetricRecord({"num-examples": num_examples(node)})}
            )
            replies.append(Message(content, reply_to=msg))
        arrays, _ = inner.aggregate_train(rnd, replies)
        assert arrays is not None
        model = tensors_from_record(arrays)
    return model


def _wrapped(inner: Strategy, **run_config: object) -> dict[str, torch.Tensor]:
    strategy = CompressionStrategy(inner, CompressionConfig.from_run_config(run_config))
    clients = {n: Client(n) for n in NODES}
    model = tiny_model()
    for rnd in range(1, ROUNDS + 1):
        new, _ = train_round(strategy, clients, rnd, model)
        assert new is not None
        model = new
    return model


@pytest.mark.parametrize("name", sorted(INNER))
def test_a_wrapped_server_optimizer_with_lossless_codecs_follows_the_plain_one(name: str) -> None:
    plain = _plain(INNER[name]())
    wrapped = _wrapped(INNER[name](), **{"uplink-codec": "identity", "downlink-codec": "identity"})
    fedavg = _plain(FedAvg(**SAMPLE_ALL))
    # Float32 rounding of R + (W - R) and of hash-ordered sums: 1e-5 of an update of scale 1e-2.
    assert max_abs_diff(wrapped, plain) < 2e-5
    # ... and the optimizer's own step matters here: FedAvg lands far from it (momentum and adaptive
    # moments move the model by ~1e-2 more over 4 rounds), so equality above is not FedAvg's.
    assert max_abs_diff(plain, fedavg) > 1e-3


@pytest.mark.parametrize("name", sorted(INNER))
def test_a_wrapped_server_optimizer_with_compression_takes_its_own_step(name: str) -> None:
    """SBC up and 3LC down: the result is not FedAvg's through the same codecs (the inner step ran on
    the decoded updates). How close it stays to the uncompressed optimizer is not a law for adaptive
    optimizers (Adam normalises each coordinate, so a sparse update moves the few it touches by
    about eta): that is for the learning-quality experiments to measure, not this test."""
    compressed = {"sbc-p": 0.1}
    opt = _wrapped(INNER[name](), **compressed)
    avg = _wrapped(FedAvg(**SAMPLE_ALL), **compressed)
    assert all(bool(torch.isfinite(v).all()) for v in opt.values())
    assert max_abs_diff(opt, avg) > 1e-3
    assert max_abs_diff(opt, tiny_model()) > 1e-3  # it moved
