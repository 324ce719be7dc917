"""DEFT's norms from the clients (``deft-norms = "clients"``, Algorithm 3 as the paper has it): each
client reports the L2 norm of every compressed tensor's accumulated update, the server plans the
next round's k from their median, and a malformed report costs that reply only. In process, the
real strategy wrapper and client mod (tests/flower/helpers.py)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message

from fedcomp.flower import protocol
from fedcomp.flower.records import record_from_tensors
from fedcomp.flower.strategy import CompressionStrategy
from fedcomp.methods.base import ClientRound
from fedcomp.methods.config import CompressionConfig
from fedcomp.methods.deft import plan_round
from fedcomp.methods.deft_uplink import DeftUplink
from fedcomp.wire.payloads import DeftAllocation, DeftPartition
from fedcomp.wire.serde import allocation_from_bytes, allocation_to_bytes
from tests.flower.helpers import (
    Client,
    FixedGrid,
    RoundLog,
    local_delta,
    make_strategy,
    server_identity,  # noqa: F401 (autouse fixture)
    tiny_model,
    train_round,
    uplink_of,
    with_fields,
)

NODES = (1, 2, 3)
LARGE = ("w1", "w2")  # tiny_model's compressed tensors, in model order ("b" goes dense)
LARGE_INDEX = {name: i for i, name in enumerate(tiny_model())}  # (their numbers on the wire)
NORMS = DeftUplink.NORMS_KEY


def _strategy(**config: Any) -> CompressionStrategy:
    return make_strategy(**{"uplink-codec": "deft", "topk-density": 0.05, **config})


def _clients() -> dict[int, Client]:
    return {n: Client(n) for n in NODES}


def _norms(rec: Any) -> list[float]:
    return np.frombuffer(rec[NORMS], dtype="<f4").tolist()


def _deft(strategy: CompressionStrategy) -> DeftUplink:
    assert isinstance(strategy.uplink, DeftUplink)
    return strategy.uplink


def _tamper(node: int, data: bytes | None):  # type: ignore[no-untyped-def]
    """A round-2 hook that replaces (or, with None, drops) ``node``'s reported norms."""

    def hook(n: int, reply: Message) -> Message:
        if n != node:
            return reply
        rec = uplink_of(reply)
        reply.content[protocol.UPLINK] = (
            with_fields(rec, drop=[NORMS]) if data is None else with_fields(rec, **{NORMS: data})
        )
        return reply

    return hook


def _second_round(tamper: Any) -> tuple[CompressionStrategy, RoundLog, dict[str, torch.Tensor] | None]:
    """Rounds 1 and 2 with all three clients, ``tamper`` on round 2's replies."""
    strategy, clients = _strategy(), _clients()
    w1, _ = train_round(strategy, clients, 1, tiny_model())
    assert w1 is not None
    w2, log = train_round(strategy, clients, 2, w1, tamper=tamper)
    return strategy, log, w2


def _lower_median_of_1_and_3(log: RoundLog) -> list[float]:
    """What the plan follows when node 2's norms are left out: the lower median of two, the smaller."""
    honest = [_norms(log.uplinks[n]) for n in (1, 3)]
    return [min(a, b) for a, b in zip(*honest, strict=True)]


def test_clients_report_their_norms_and_the_next_round_is_planned_from_their_median() -> None:
    strategy, clients = _strategy(), _clients()
    w1, log1 = train_round(strategy, clients, 1, tiny_model())
    assert w1 is not None and strategy.traffic[1].rejected == {}
    assert all(allocation_from_bytes(rec[DeftUplink.ALLOCATION_KEY]).report_norms for rec in log1.downlinks.values())
    reported = {}
    for n in NODES:
        # Round 1: nothing in the residual yet, so the accumulated update is the local one.
        d = local_delta(n, 1, tiny_model())
        expected = [float(torch.linalg.vector_norm(d[k])) for k in LARGE]
        reported[n] = _norms(log1.uplinks[n])
        assert reported[n] == pytest.approx(expected, rel=1e-5)
        assert len(log1.uplinks[n][NORMS]) == 4 * len(LARGE)
    # The lower median of each tensor's three reports, in float64 from the float32 sent.
    median = [sorted(reported[n][i] for n in NODES)[1] for i in range(len(LARGE))]
    assert _deft(strategy).norms == median
    # Each reply's bytes count as its uplink, norms included.
    assert all(strategy.traffic[1].uplink[n] > len(log1.uplinks[n]["payload"]) for n in NODES)

    assert strategy.round_metrics(1)["deft_k_from"] == "sizes"  # (round 1's plan)
    _w2, log2 = train_round(strategy, clients, 2, w1)
    numels = [tiny_model()[k].numel() for k in LARGE]
    planned = plan_round(numels, median, 0.05, len(NODES), 2)
    for i, n in enumerate(NODES):
        got = allocation_from_bytes(log2.downlinks[n][DeftUplink.ALLOCATION_KEY])
        expected_parts = tuple(
            DeftPartition(LARGE_INDEX[LARGE[p.tensor]], p.start, p.stop, p.k) for p in planned[i].partitions
        )
        assert got == DeftAllocation(2, expected_parts, report_norms=True)
    metrics = strategy.round_metrics(2)
    assert metrics["deft_k_from"] == "clients"
    # k per compressed tensor: its partitions' k over all clients, the round's whole budget.
    assert metrics["deft_k"] == {
        name: sum(p.k for a in planned for p in a.partitions if LARGE[p.tensor] == name) for name in LARGE
    }
    assert sum(metrics["deft_k"].values()) == round(0.05 * sum(numels))


def test_a_client_reports_the_norm_of_its_residual_plus_its_update() -> None:
    replica = tiny_model()
    parts = (DeftPartition(0, 0, 2000, 100), DeftPartition(1, 0, 1200, 60))
    residual = {"w1": torch.full((40, 50), 0.5)}
    update = {k: torch.full_like(v, 0.25) for k, v in replica.items()}

    def extras(report: bool) -> dict[str, bytes]:
        alloc = allocation_to_bytes(DeftAllocation(1, parts, report_norms=report))
        rnd = ClientRound({"id": "topk", "p": 0.05}, replica, 1000, 1, {DeftUplink.ALLOCATION_KEY: alloc}, _NoStore())
        return DeftUplink.client_extras(rnd, residual, update)

    got = np.frombuffer(extras(True)[NORMS], dtype="<f4")
    assert got.tolist() == pytest.approx([0.75 * 2000**0.5, 0.25 * 1200**0.5], rel=1e-6)
    assert extras(False) == {}  # a server that does not ask gets nothing (an older server)


class _NoStore:
    def load(self) -> None:
        return None

    def save(self, values: Any) -> None:
        raise AssertionError("DEFT's client keeps no state")

    def clear(self) -> None:
        pass


@pytest.mark.parametrize(
    ("data", "word"),
    [
        (np.array([1.0], dtype="<f4").tobytes(), "has 4 bytes, expected 8"),
        (np.array([1.0, np.nan], dtype="<f4").tobytes(), "not finite"),
        (np.array([1.0, np.inf], dtype="<f4").tobytes(), "not finite"),
        (np.array([-1.0, 1.0], dtype="<f4").tobytes(), "negative"),
        (b"", "has 0 bytes"),
    ],
    ids=["short", "nan", "inf", "negative", "empty"],
)
def test_malformed_norms_reject_that_reply_and_the_round_goes_on(data: bytes, word: str) -> None:
    strategy, log, w2 = _second_round(_tamper(2, data))
    rejected = strategy.traffic[2].rejected
    assert set(rejected) == {2} and NORMS in rejected[2] and word in rejected[2], rejected
    assert w2 is not None
    assert _deft(strategy).norms == _lower_median_of_1_and_3(log)  # the accepted replies' only


def test_a_reply_without_norms_is_aggregated_and_the_others_plan() -> None:
    strategy, log, _w2 = _second_round(_tamper(2, None))
    assert strategy.traffic[2].rejected == {}
    assert _deft(strategy).norms == _lower_median_of_1_and_3(log)


def test_one_client_claiming_huge_norms_does_not_move_the_plan_past_the_honest_ones() -> None:
    huge = np.array([3e38, 0.0], dtype="<f4").tobytes()  # all of k to w1, none to w2
    strategy, log, _w2 = _second_round(_tamper(2, huge))
    honest = [_norms(log.uplinks[n]) for n in (1, 3)]
    norms = _deft(strategy).norms
    assert norms is not None
    for i in range(len(LARGE)):
        assert min(h[i] for h in honest) <= norms[i] <= max(h[i] for h in honest)


def test_a_rejected_reply_s_norms_are_not_used() -> None:
    def corrupt(n: int, reply: Message) -> Message:  # node 2's norms read well, its update does not
        reply = _tamper(2, np.array([1e6, 1e6], dtype="<f4").tobytes())(n, reply)
        if n == 2:
            payload = bytearray(uplink_of(reply)["payload"])  # type: ignore[arg-type]
            payload[-1] ^= 0xFF  # (its CRC-32)
            reply.content[protocol.UPLINK] = with_fields(uplink_of(reply), payload=bytes(payload))
        return reply

    strategy, log, _w2 = _second_round(corrupt)
    assert set(strategy.traffic[2].rejected) == {2}
    assert _deft(strategy).norms == _lower_median_of_1_and_3(log)


def test_with_aggregate_norms_nothing_is_asked_or_sent() -> None:
    strategy, clients = _strategy(**{"deft-norms": "aggregate"}), _clients()
    w1, log = train_round(strategy, clients, 1, tiny_model())
    assert w1 is not None
    for n in NODES:
        assert not allocation_from_bytes(log.downlinks[n][DeftUplink.ALLOCATION_KEY]).report_norms
        assert NORMS not in log.uplinks[n]
    deft = _deft(strategy)
    assert deft.norms is None and deft.aggregate is not None
    assert strategy.round_metrics(1)["deft_k_from"] == "sizes"
    # A client that reports anyway is not listened to.
    _w2, _ = train_round(strategy, clients, 2, w1, tamper=_tamper(2, np.ones(2, dtype="<f4").tobytes()))
    assert strategy.traffic[2].rejected == {} and deft.norms is None
    assert strategy.round_metrics(2)["deft_k_from"] == "aggregate"


def test_the_norms_survive_a_checkpoint_and_one_round_s_reports_do_not() -> None:
    strategy, clients = _strategy(), _clients()
    w1, _ = train_round(strategy, clients, 1, tiny_model())
    assert w1 is not None
    state = strategy.state_dict()
    assert {"_reported", "_accepted"}.isdisjoint(state["uplink"])
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    again = _strategy()
    again.load_state_dict(torch.load(buffer, weights_only=True))
    assert _deft(again).norms == _deft(strategy).norms is not None
    allocations = [
        {
            m.metadata.dst_node_id: m.content.config_records[protocol.DOWNLINK][DeftUplink.ALLOCATION_KEY]
            for m in s.configure_train(2, record_from_tensors(w1), ConfigRecord({}), FixedGrid(NODES))
        }
        for s in (strategy, again)
    ]
    assert allocations[0] == allocations[1]


@pytest.mark.parametrize(
    ("norms", "said"), [("clients", "the clients' reported norms"), ("aggregate", "the last aggregate's norms")]
)
def test_the_run_s_description_says_where_k_comes_from(norms: str, said: str) -> None:
    config = CompressionConfig.from_run_config({"uplink-codec": "deft", "deft-norms": norms})
    assert f"uplink deft {{'id': 'topk', 'p': 0.01}} (p of all clients together; k by {said})" in config.describe()
