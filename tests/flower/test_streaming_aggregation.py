"""Streaming server aggregation: replies summed as they are decoded, equal to materialising them.

For FedAvg and the server optimisers built on its weighted mean (FedAvgM, FedAdam, ...) the wrapper
sums each decoded reply into a float64 running sum and hands the inner strategy one reply carrying
the mean; strategies that need every reply (FedMedian, Krum, trimmed mean) get every reply as a
full model. Each test runs the real wrapper, the real ``compression_mod`` on every client and real
payloads, once per path, and compares.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp.strategy import (
    Bulyan,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Krum,
    Strategy,
)

from fedcomp.flower import protocol
from fedcomp.flower.records import record_from_tensors, tensors_from_record
from fedcomp.flower.settings import CompressionConfig
from fedcomp.flower.strategy import CompressionStrategy, streams_weighted_mean
from fedcomp.wire import serde
from fedcomp.wire.payloads import SBCPayload
from tests.flower.helpers import (
    METRICS,
    SAMPLE_ALL,
    Client,
    FixedGrid,
    max_abs_diff,
    num_examples,
    server_identity,
    tiny_model,
)

__all__ = ["server_identity"]  # the autouse fixture, imported so it applies here

NODES = (1, 2, 3, 4, 5)
ROUNDS = 3

INNER: dict[str, Callable[[], Strategy]] = {
    "fedavg": lambda: FedAvg(**SAMPLE_ALL),
    "fedavgm": lambda: FedAvgM(server_momentum=0.9, server_learning_rate=1.0, **SAMPLE_ALL),
    "fedadam": lambda: FedAdam(eta=0.05, tau=1e-3, **SAMPLE_ALL),
}


class Spy:
    """Wraps an inner strategy's ``aggregate_train`` (on the instance: the wrapper's detection
    reads the class) and records how many content replies it was handed each call."""

    def __init__(self, inner: Strategy) -> None:
        self.seen: list[int] = []
        real = inner.aggregate_train

        def spy(server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
            replies = list(replies)
            self.seen.append(sum(1 for m in replies if not m.has_error()))
            return real(server_round, replies)

        inner.aggregate_train = spy  # type: ignore[method-assign]


def _with_loss(node: int, reply: Message) -> Message:
    """Give each reply a metric of its own besides the weight (the aggregated metrics must see all)."""
    if reply.has_content():
        reply.content[METRICS] = MetricRecord({"num-examples": num_examples(node), "loss": 1.0 + node})
    return reply


def _run(
    inner: Strategy, streaming: bool, rounds: int = ROUNDS, shuffle: int | None = None, **run_config: Any
) -> tuple[CompressionStrategy, list[dict[str, torch.Tensor]], list[MetricRecord | None], Spy]:
    """``rounds`` train rounds of the wrapped ``inner`` on the given path; the model and metrics
    after each. ``shuffle``: the replies reach the server in an order shuffled with this seed."""
    strategy = CompressionStrategy(inner, CompressionConfig.from_run_config({"sbc-p": 0.1, **run_config}))
    strategy.streaming = streaming
    spy = Spy(inner)
    clients = {n: Client(n) for n in NODES}
    model = tiny_model()
    models, metrics = [], []
    for rnd in range(1, rounds + 1):
        msgs = list(
            strategy.configure_train(rnd, record_from_tensors(model), ConfigRecord({"lr": 0.1}), FixedGrid(NODES))
        )
        replies = [_with_loss(m.metadata.dst_node_id, clients[m.metadata.dst_node_id].handle(m)) for m in msgs]
        if shuffle is not None:
            random.Random(shuffle + rnd).shuffle(replies)
        arrays, mets = strategy.aggregate_train(rnd, replies)
        assert arrays is not None
        model = tensors_from_record(arrays)
        models.append(model)
        metrics.append(mets)
    return strategy, models, metrics, spy


@pytest.mark.parametrize("name", sorted(INNER))
def test_streaming_equals_materialising_and_the_inner_step_sees_one_reply(name: str) -> None:
    s_strategy, streamed, s_metrics, s_spy = _run(INNER[name](), streaming=True)
    m_strategy, materialised, m_metrics, m_spy = _run(INNER[name](), streaming=False)
    assert CompressionStrategy(INNER[name]()).streaming  # detected: the default path
    for rnd in range(ROUNDS):
        # Float32 sums of five replies against a float64 sum: rounding only (updates are ~1e-2).
        assert max_abs_diff(streamed[rnd], materialised[rnd]) < 1e-6
        assert max_abs_diff(streamed[rnd], tiny_model()) > 1e-3  # and the model moved
        s_mets, m_mets = s_metrics[rnd], m_metrics[rnd]
        assert s_mets is not None and m_mets is not None
        weights = {n: num_examples(n) for n in NODES}
        expected_loss = sum(w * (1.0 + n) for n, w in weights.items()) / sum(weights.values())
        assert s_mets["loss"] == pytest.approx(expected_loss, rel=1e-12)  # every reply's metric
        assert m_mets["loss"] == pytest.approx(expected_loss, rel=1e-12)
        for key in ("fedcomp.uplink-bytes", "fedcomp.downlink-bytes"):
            assert s_mets[key] == m_mets[key]
    # The inner strategy got one reply carrying the mean (streaming), or every reply.
    assert s_spy.seen == [1] * ROUNDS
    assert m_spy.seen == [len(NODES)] * ROUNDS
    assert s_strategy.traffic[ROUNDS].accepted == m_strategy.traffic[ROUNDS].accepted == len(NODES)


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "materialising"])
def test_neither_path_depends_on_arrival_order(streaming: bool) -> None:
    """Bit-identical models whatever order the replies arrive in (the replies are summed in the
    order of their payloads' hashes; the materialising path's float32 sums need that order)."""
    _, a, _, _ = _run(FedAvg(**SAMPLE_ALL), streaming=streaming, rounds=2, shuffle=1)
    _, b, _, _ = _run(FedAvg(**SAMPLE_ALL), streaming=streaming, rounds=2, shuffle=7)
    for x, y in zip(a, b, strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)  # bit-identical, not merely close


@pytest.mark.parametrize(
    "uplink",
    [
        {"uplink-codec": "deft", "topk-density": 0.2},
        {"uplink-codec": "topk", "topk-density": 0.2},
        {"uplink-codec": "stc"},
        {"uplink-codec": "dense-fp16"},
        # Two dense rounds (the PCA samples), then coefficients aggregated without decompressing.
        {"uplink-codec": "gradiveq", "gradiveq-dense-rounds": 2, "gradiveq-refresh": 0},
    ],
    ids=lambda c: c["uplink-codec"],
)
def test_methods_with_their_own_decode_stream_to_the_same_model(uplink: dict[str, Any]) -> None:
    rounds = 4 if uplink["uplink-codec"] == "gradiveq" else ROUNDS
    s_strategy, streamed, _, _ = _run(FedAvg(**SAMPLE_ALL), streaming=True, rounds=rounds, **uplink)
    m_strategy, materialised, _, _ = _run(FedAvg(**SAMPLE_ALL), streaming=False, rounds=rounds, **uplink)
    for rnd in range(rounds):
        assert max_abs_diff(streamed[rnd], materialised[rnd]) < 1e-6
    # the selection's union (top-k: noted from positions and values when streaming) is the same
    unions = [[(t.union_nnz, t.sparse_numel) for _, t in sorted(s.traffic.items())] for s in (s_strategy, m_strategy)]
    assert unions[0] == unions[1]
    if uplink["uplink-codec"] in ("topk", "deft"):
        assert all(nnz > 0 for nnz, _ in unions[0])
    # Counted once the round is aggregated, and the masks released (they were kept every round).
    assert all(not t._union for s in (s_strategy, m_strategy) for t in s.traffic.values())
    if uplink["uplink-codec"] == "gradiveq":
        assert s_strategy.uplink.round_metrics(rounds)["gradiveq_compressed"]  # the compressed domain ran


@pytest.mark.parametrize(
    ("make", "streams"),
    [
        (lambda: FedAvg(), True),
        (lambda: FedProx(), True),
        (lambda: FedAvgM(), True),
        (lambda: FedAdam(), True),
        (lambda: FedYogi(), True),
        (lambda: FedAdagrad(), True),
        (lambda: FedMedian(), False),
        (lambda: Krum(), False),
        (lambda: FedTrimmedAvg(), False),
        (lambda: Bulyan(), False),
    ],
    ids=["fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedmedian", "krum", "trimmed", "bulyan"],
)
def test_which_inner_strategies_stream(make: Callable[[], Strategy], streams: bool) -> None:
    assert streams_weighted_mean(make()) is streams
    assert CompressionStrategy(make()).streaming is streams


def test_a_subclass_with_its_own_aggregation_is_materialised() -> None:
    class Clipped(FedAvg):
        def aggregate_train(
            self, server_round: int, replies: Iterable[Message]
        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
            return super().aggregate_train(server_round, replies)

    assert not streams_weighted_mean(Clipped())


def test_fedmedian_still_gets_every_reply_as_a_full_model() -> None:
    strategy, models, _, spy = _run(FedMedian(**SAMPLE_ALL), streaming=CompressionStrategy(FedMedian()).streaming)
    assert not strategy.streaming
    assert spy.seen == [len(NODES)] * ROUNDS
    # The median of W + delta_i is not the mean: the same rounds through FedAvg land elsewhere.
    _, mean_models, _, _ = _run(FedAvg(**SAMPLE_ALL), streaming=True)
    assert max_abs_diff(models[-1], mean_models[-1]) > 1e-4


def _bad_second_tensor(payload: bytes) -> bytes:
    """The update with its second tensor's SBC payload claiming more positions than the tensor
    has (a valid envelope and checksum): decoding fails after the first tensor decoded fine."""
    update = serde.update_from_bytes(payload)
    enc = update.tensors[1]
    assert isinstance(enc.payload, SBCPayload)
    bad = replace(enc, payload=replace(enc.payload, nnz=1201))
    return serde.update_to_bytes(replace(update, tensors=(update.tensors[0], bad, *update.tensors[2:])))


def test_a_reply_rejected_halfway_through_decoding_adds_nothing_to_the_sum() -> None:
    """Node 3's first tensor decodes, its second does not: the streamed model equals the one the
    materialising path gets from the same replies (nothing of node 3 in either)."""

    def run(streaming: bool) -> tuple[CompressionStrategy, dict[str, torch.Tensor]]:
        strategy = CompressionStrategy(FedAvg(**SAMPLE_ALL), CompressionConfig.from_run_config({"sbc-p": 0.1}))
        strategy.streaming = streaming
        clients = {n: Client(n) for n in NODES}
        model = tiny_model()
        msgs = list(
            strategy.configure_train(1, record_from_tensors(model), ConfigRecord({"lr": 0.1}), FixedGrid(NODES))
        )
        replies = [clients[m.metadata.dst_node_id].handle(m) for m in msgs]
        for reply in replies:
            if reply.metadata.src_node_id == 3:
                rec = reply.content.config_records[protocol.UPLINK]
                payload = rec["payload"]
                assert isinstance(payload, bytes)
                rec["payload"] = _bad_second_tensor(payload)
        arrays, _ = strategy.aggregate_train(1, replies)
        assert arrays is not None
        return strategy, tensors_from_record(arrays)

    streamed, s_model = run(True)
    materialised, m_model = run(False)
    assert streamed.traffic[1].rejected == materialised.traffic[1].rejected
    assert list(streamed.traffic[1].rejected) == [3]
    assert "nnz 1201 exceeds" in streamed.traffic[1].rejected[3]
    assert streamed.traffic[1].accepted == len(NODES) - 1
    assert max_abs_diff(s_model, m_model) < 1e-6
