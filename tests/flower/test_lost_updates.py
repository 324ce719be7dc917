"""No update is lost (protocol 2): the server reports each node's last update outcome in every
downlink, and a client whose update was rejected, timed out or dropped adds it back to its
residual. The invariant, per client, over a multi-round run with the real strategy and mod:

    sum(updates the inner strategy aggregated) + residual == sum(local updates)   (fp32 tolerance)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedcomp.errors import PayloadError
from fedcomp.flower import mod as mod_module
from fedcomp.flower import protocol
from fedcomp.flower.pending import PendingUpdate
from fedcomp.flower.protocol import UpdateStatus
from fedcomp.flower.records import record_from_tensors, tensors_from_record
from fedcomp.flower.settings import CompressionConfig
from fedcomp.flower.strategy import CompressionStrategy
from fedcomp.methods.base import UplinkMethod
from fedcomp.wire.serde import update_from_bytes, update_to_bytes
from tests.flower.helpers import (  # noqa: F401  (server_identity: autouse fixture)
    ARRAYS,
    Client,
    FixedGrid,
    downlink_of,
    evaluate_round,
    server_identity,
    tiny_model,
    train_round,
    with_fields,
)

NODES = (1, 2, 3, 4)
BOUND = 5.0  # max-update-norm: honest updates here are ~0.6, a boosted one ~100x that


class RecordingFedAvg(FedAvg):
    """FedAvg that records, per round and node, the arrays it aggregated (``W + update``)."""

    def __init__(self) -> None:
        super().__init__(
            fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1
        )
        self.aggregated: dict[int, dict[int, dict[str, torch.Tensor]]] = {}

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> Any:
        replies = list(replies)
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            self.aggregated[server_round] = {
                m.metadata.src_node_id: tensors_from_record(m.content.array_records[ARRAYS])
                for m in replies
                if not m.has_error()
            }
        return arrays, metrics


class LedgerClient(Client):
    """A client that records every local update it trained (also those whose reply is lost), and
    trains 1000x too far in ``boost_round`` (its update then exceeds max-update-norm)."""

    def __init__(self, node: int, boost_round: int | None = None) -> None:
        super().__init__(node)
        self.boost_round = boost_round
        #: (round, local update) for every train message it handled, in order.
        self.trained: list[tuple[int, dict[str, torch.Tensor]]] = []

    def app(self, msg: Message, ctx: Any) -> Message:
        reply = super().app(msg, ctx)
        if msg.metadata.message_type != MessageType.TRAIN:
            return reply
        rnd = int(msg.content.config_records[protocol.CONFIG_RECORD][protocol.SERVER_ROUND])  # type: ignore[arg-type]
        received, delta = self.seen[rnd]
        if rnd == self.boost_round:
            delta = {k: 1000.0 * v for k, v in delta.items()}
            content = RecordDict(dict(reply.content.items()))
            content[ARRAYS] = record_from_tensors({k: received[k] + delta[k] for k in received})
            reply.content = content
        self.trained.append((rnd, delta))
        return reply

    def residual(self) -> dict[str, torch.Tensor]:
        rec = self.ctx.state.array_records.get(protocol.STATE_RESIDUAL)
        return tensors_from_record(rec) if rec is not None else {}


def _payload(reply: Message, change: Any) -> Message:
    up = reply.content.config_records[protocol.UPLINK]
    content = RecordDict(dict(reply.content.items()))
    content[protocol.UPLINK] = with_fields(up, payload=change(up["payload"]))
    reply.content = content
    return reply


def truncated(reply: Message) -> Message:
    return _payload(reply, lambda p: p[: len(p) // 2])


def stale(reply: Message) -> Message:
    def older(p: bytes) -> bytes:
        update = update_from_bytes(p)
        return update_to_bytes(dataclasses.replace(update, base_model_version=update.base_model_version - 1))

    return _payload(reply, older)


#: round -> (nodes sampled, {node: tamper}, nodes whose reply never arrives). Node 3 trains 1000x
#: too far in round 7: a client that does not keep within the server's norm bound (a mod before
#: the field) is rejected then, and again in round 8 (it carries it); the mod sends the bound's
#: worth and keeps the rest in its residual.
SCHEDULE: dict[int, tuple[tuple[int, ...], dict[int, Any], tuple[int, ...]]] = {
    1: (NODES, {}, ()),
    2: (NODES, {1: truncated}, ()),
    3: ((1, 2, 3), {2: stale}, ()),
    4: (NODES, {}, (1, 3)),
    5: (NODES, {}, (1,)),
    6: ((1, 2, 3), {2: truncated}, ()),
    7: (NODES, {}, ()),
    8: (NODES, {}, ()),
}
EXPECTED_REJECTED = {2: {1}, 3: {2}, 6: {2}}
UNCLIPPED_REJECTED = {**EXPECTED_REJECTED, 7: {3}, 8: {3}}


def _run(method: str, **run_config: Any) -> tuple[CompressionStrategy, RecordingFedAvg, dict, dict]:
    inner = RecordingFedAvg()
    config = {"uplink-codec": method, "max-update-norm": BOUND, **run_config}
    strategy = CompressionStrategy(inner, CompressionConfig.from_run_config(config))
    clients = {n: LedgerClient(n, boost_round=7 if n == 3 else None) for n in NODES}
    model = tiny_model()
    models = {}
    for rnd, (nodes, tampers, drop) in SCHEDULE.items():
        models[rnd] = model

        def tamper(node: int, reply: Message, tampers: dict = tampers) -> Message:
            return tampers[node](reply) if node in tampers else reply

        new, _ = train_round(strategy, clients, rnd, model, nodes=nodes, tamper=tamper, drop=drop)
        assert new is not None
        model = new
    # The evaluate messages after the last round carry its outcomes: every pending update settles.
    evaluate_round(strategy, clients, max(SCHEDULE), model)
    return strategy, inner, clients, models


def _gap(client: LedgerClient, inner: Iterable[tuple[RecordingFedAvg, dict[int, dict[str, torch.Tensor]]]]) -> float:
    """max |sum(aggregated) + residual - sum(trained)| for ``client``, over the (inner strategy,
    round -> model W it aggregated against) pairs of a run (two after a server restart)."""
    like = tiny_model()
    aggregated = [
        {k: got[client.node][k] - models[rnd][k] for k in like}
        for strategy, models in inner
        for rnd, got in sorted(strategy.aggregated.items())
        if client.node in got
    ]
    residual = {k: client.residual().get(k, torch.zeros_like(v)) for k, v in like.items()}
    lhs = _sum([*aggregated, residual], like)
    rhs = _sum([d for _, d in client.trained], like)
    return max(float((lhs[k] - rhs[k]).abs().max()) for k in like)


def _sum(tensors: Iterable[dict[str, torch.Tensor]], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in like.items()}
    for t in tensors:
        for k in out:
            out[k] += t[k].double()
    return out


@pytest.mark.parametrize("clips", [True, False], ids=["client-keeps-the-bound", "client-ignores-it"])
@pytest.mark.parametrize("method", ["sbc", "stc", "topk", "deft", "dense-fp32", "dense-fp16", "identity"])
def test_every_local_update_is_aggregated_or_still_in_the_residual(
    method: str, clips: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not clips:
        monkeypatch.setattr(mod_module, "_max_update_norm", lambda dl: None)
    strategy, inner, clients, models = _run(method)
    # The faults happened as scripted: rejections with their reasons, replies that never came.
    rejected = {r: set(t.rejected) for r, t in strategy.traffic.items() if t.rejected}
    expected = EXPECTED_REJECTED if clips else UNCLIPPED_REJECTED
    assert rejected == expected, {r: t.rejected for r, t in strategy.traffic.items()}
    assert strategy.traffic[2].rejected[1].startswith("payload:")  # the decoder's typed error
    assert "expected" in strategy.traffic[3].rejected[2] and "version" in strategy.traffic[3].rejected[2]
    if clips:  # node 3 sent the bound's worth in rounds 7 and 8, and was aggregated
        assert all(BOUND * 0.99 < strategy.traffic[r].update_norm[3] <= BOUND for r in (7, 8))
    else:
        assert "max-update-norm" in strategy.traffic[7].rejected[3]
    assert {r: len(t.unanswered) for r, t in strategy.traffic.items() if t.unanswered} == {4: 2, 5: 1}
    for node, client in clients.items():
        assert protocol.STATE_PENDING not in client.ctx.state.config_records, node  # all settled
        # Updates are ~0.01 per entry (node 3's boosted one ~10): float32 sums of a few rounds.
        assert _gap(client, [(inner, models)]) < 2e-5, node
    # Delivery, not only bookkeeping: the dense bias goes whole, so a node whose last update was
    # aggregated holds no residual for it, whatever it lost before (node 3's stays rejected).
    for node in (1, 2, 4):
        assert float(clients[node].residual().get("b", torch.zeros(1)).abs().max()) == 0.0, node
    assert float(clients[3].residual()["b"].abs().max()) > 1.0
    # Node 4 sat out rounds 3 and 6 (nothing in flight) and lost nothing: all 6 updates aggregated.
    assert sum(4 in got for got in inner.aggregated.values()) == 6


def test_without_outcomes_the_lost_updates_are_missing() -> None:
    """The same run with the client's recovery switched off breaks the invariant: what the test
    above checks is not true of any run."""
    original = UplinkMethod.client_recover
    try:
        UplinkMethod.client_recover = classmethod(lambda cls, lost, residual: dict(residual))  # type: ignore[method-assign,assignment]
        _, inner, clients, models = _run("sbc")
    finally:
        UplinkMethod.client_recover = original  # type: ignore[method-assign]
    assert _gap(clients[1], [(inner, models)]) > 1e-3  # node 1 lost its updates of rounds 2, 4 and 5


def test_the_downlink_reports_the_last_update_and_a_lost_one_goes_back_into_the_residual() -> None:
    strategy = CompressionStrategy(RecordingFedAvg(), CompressionConfig.from_run_config({}))
    clients = {n: LedgerClient(n) for n in (1, 2)}
    model = tiny_model()
    new, log1 = train_round(strategy, clients, 1, model)
    assert new is not None
    head = protocol.DownlinkHeader.from_record(log1.downlinks[1])
    assert head.protocol == 2 and head.outcome == protocol.UpdateOutcome(1, 0, 0, UpdateStatus.NONE)
    assert protocol.UplinkReport.from_record(log1.uplinks[1]).update_round == 1
    pending = PendingUpdate.from_record(clients[1].ctx.state.config_records[protocol.STATE_PENDING])
    assert pending.round == 1
    residual_before = clients[2].residual()
    # Round 2: node 2's reply is truncated; node 1's was aggregated in round 1.
    new2, log2 = train_round(strategy, clients, 2, new, tamper=lambda n, r: truncated(r) if n == 2 else r)
    assert new2 is not None
    assert protocol.DownlinkHeader.from_record(log2.downlinks[1]).outcome == protocol.UpdateOutcome(
        2, 1, 1, UpdateStatus.AGGREGATED
    )
    sent2 = PendingUpdate.from_record(clients[2].ctx.state.config_records[protocol.STATE_PENDING]).tensors
    residual2 = clients[2].residual()
    # Round 3's downlink tells node 2 its round-2 update was rejected and why; it adds it back.
    _, log3 = train_round(strategy, clients, 3, new2, nodes=[1])
    _, log_e = evaluate_round(strategy, clients, 3, new2, nodes=[2])
    out = protocol.DownlinkHeader.from_record(log_e.downlinks[2]).outcome
    assert out is not None and (out.round, out.settled_round, out.last_update_round) == (3, 3, 2)
    assert out.last_update_status is UpdateStatus.REJECTED
    assert out.last_update_reason == strategy.traffic[2].rejected[2] and out.last_update_reason.startswith("payload:")
    assert protocol.STATE_PENDING not in clients[2].ctx.state.config_records
    recovered = clients[2].residual()
    for k in residual2:
        torch.testing.assert_close(recovered[k], residual2[k] + sent2[k], rtol=0, atol=1e-7)
    assert torch.equal(recovered["b"], sent2["b"])  # the dense bias: no residual before, now the update
    assert residual_before.keys() == residual2.keys() == {"w1", "w2"}
    # Node 2 trains again: its next update carries the lost one (the bias exactly), and is accepted.
    new3, log4 = train_round(strategy, clients, 4, new2, nodes=[2])
    assert new3 is not None and strategy.traffic[4].accepted == 1
    assert float(clients[2].residual()["b"].abs().max()) == 0.0


def test_an_evaluate_before_the_round_is_aggregated_keeps_waiting_and_a_server_that_went_back_settles() -> None:
    inner = RecordingFedAvg()
    strategy = CompressionStrategy(inner, CompressionConfig.from_run_config({}))
    client = LedgerClient(1)
    model = tiny_model()
    new, _ = train_round(strategy, {1: client}, 1, model)
    assert new is not None
    msgs = list(strategy.configure_train(2, record_from_tensors(new), ConfigRecord({}), FixedGrid([1])))
    client.handle(msgs[0])  # round 2's update is sent; the server crashes before aggregating it
    state = client.ctx.state
    assert PendingUpdate.from_record(state.config_records[protocol.STATE_PENDING]).round == 2
    # An evaluate message built before round 2 was aggregated (settled-round 1): keep waiting.
    early = list(strategy.configure_evaluate(1, record_from_tensors(new), ConfigRecord({}), FixedGrid([1])))
    outcome = protocol.DownlinkHeader.from_record(downlink_of(early[0])).outcome
    assert outcome is not None and outcome.settled_round == 1
    client.handle(early[0])
    assert PendingUpdate.from_record(state.config_records[protocol.STATE_PENDING]).round == 2
    # The server resumes from its checkpoint after round 1 (model and outcome records) and asks
    # for round 2 again: the client counts the update it never heard of as not aggregated.
    saved = strategy.outcome_state()
    saved["settled-round"] = 1
    inner2 = RecordingFedAvg()
    restarted = CompressionStrategy(inner2, CompressionConfig.from_run_config({}))
    restarted.load_outcome_state(saved)
    new2, log = train_round(restarted, {1: client}, 2, new)
    assert new2 is not None
    outcome = protocol.DownlinkHeader.from_record(log.downlinks[1]).outcome
    assert outcome is not None and (outcome.round, outcome.settled_round) == (2, 1)
    assert [r for r, _ in client.trained] == [1, 2, 2]
    evaluate_round(restarted, {1: client}, 2, new2)
    assert protocol.STATE_PENDING not in state.config_records
    # Round 1 (first server) and the second round 2 (restarted) aggregated; the first round 2's
    # update is in the residual.
    assert _gap(client, [(inner, {1: model}), (inner2, {2: new})]) < 2e-5


def test_a_protocol_1_server_gets_no_echo_and_the_client_keeps_nothing() -> None:
    strategy = CompressionStrategy(RecordingFedAvg(), CompressionConfig.from_run_config({}))
    clients = {1: LedgerClient(1)}

    model = tiny_model()
    msgs = strategy.configure_train(1, record_from_tensors(model), ConfigRecord({}), FixedGrid([1]))
    msgs = [_strip_outcome(m) for m in msgs]
    reply = clients[1].handle(msgs[0])
    assert not reply.has_error()
    assert protocol.UplinkReport.from_record(reply.content.config_records[protocol.UPLINK]).update_round is None
    assert protocol.STATE_PENDING not in clients[1].ctx.state.config_records
    arrays, _ = strategy.aggregate_train(1, [reply])
    assert arrays is not None and strategy.traffic[1].accepted == 1


def test_a_reply_that_echoes_another_round_is_rejected() -> None:
    strategy = CompressionStrategy(RecordingFedAvg(), CompressionConfig.from_run_config({}))
    clients = {1: LedgerClient(1), 2: LedgerClient(2)}

    def other_round(node: int, reply: Message) -> Message:
        if node != 2:
            return reply
        content = RecordDict(dict(reply.content.items()))
        content[protocol.UPLINK] = with_fields(reply.content.config_records[protocol.UPLINK], update_round=7)
        reply.content = content
        return reply

    new, _ = train_round(strategy, clients, 1, tiny_model(), tamper=other_round)
    assert new is not None
    assert strategy.traffic[1].rejected == {2: "payload: uplink: field 'update-round' is 7, this is round 1"}
    assert strategy.outcome_state()["last-update"]["2"][:2] == [1, "rejected"]


def test_gradiveq_keeps_no_pending_update_a_lost_one_is_lost() -> None:
    strategy = CompressionStrategy(RecordingFedAvg(), CompressionConfig.from_run_config({"uplink-codec": "gradiveq"}))
    clients = {1: LedgerClient(1)}
    new, _ = train_round(strategy, clients, 1, tiny_model(), drop=[1])
    assert new is None  # nothing arrived
    assert protocol.STATE_PENDING not in clients[1].ctx.state.config_records
    _, _ = train_round(strategy, clients, 2, tiny_model())
    assert clients[1].residual() == {}


def test_the_outcome_records_survive_a_checkpoint_and_reject_garbage() -> None:
    strategy = CompressionStrategy(RecordingFedAvg(), CompressionConfig.from_run_config({}))
    clients = {n: LedgerClient(n) for n in (1, 2)}
    train_round(strategy, clients, 1, tiny_model(), tamper=lambda n, r: truncated(r) if n == 2 else r)
    saved = strategy.outcome_state()
    assert saved["settled-round"] == 1
    assert saved["last-update"]["1"] == [1, "aggregated", ""] and saved["last-update"]["2"][:2] == [1, "rejected"]
    assert saved["unsettled"] == {"1": 1, "2": 1}  # sent round 1, not yet told its outcome
    other = CompressionStrategy(RecordingFedAvg(), CompressionConfig.from_run_config({}))
    other.load_outcome_state(saved)
    assert other.outcome_state() == saved
    for bad in (
        {},
        {"records-from-round": 1, "settled-round": 1, "last-update": {"1": [1, "maybe", ""]}},
        {"records-from-round": 1, "settled-round": "x", "last-update": {}},
        {"records-from-round": 1, "settled-round": 1, "last-update": {"1": [2, "aggregated", ""]}},
        {"records-from-round": 3, "settled-round": 1, "last-update": {}},
        {"records-from-round": 1, "settled-round": 1, "last-update": []},
        {"records-from-round": 1, "settled-round": 1, "last-update": {}, "unsettled": {"1": 3}},
        {"records-from-round": 1, "settled-round": 1, "last-update": {}, "unsettled": {"x": 1}},
    ):
        with pytest.raises(PayloadError, match="outcome state"):
            other.load_outcome_state(bad)
    assert other.outcome_state() == saved  # unchanged by the failed loads


class DivergingLedgerClient(LedgerClient):
    """Its training produces NaN in round 3."""

    def app(self, msg: Message, ctx: Any) -> Message:
        reply = super().app(msg, ctx)
        cfg = msg.content.config_records[protocol.CONFIG_RECORD]
        if msg.metadata.message_type == MessageType.TRAIN and cfg[protocol.SERVER_ROUND] == 3:
            arrays = reply.content.array_records[ARRAYS].to_torch_state_dict()
            next(iter(arrays.values())).view(-1)[0] = float("nan")
            reply.content[ARRAYS] = ArrayRecord(arrays)
            self.trained.pop()  # a diverged update is no local update: it is never sent
        return reply


def test_a_diverged_round_after_a_rejected_one_settles_it_and_keeps_the_rest() -> None:
    inner = RecordingFedAvg()
    strategy = CompressionStrategy(inner, CompressionConfig.from_run_config({}))
    clients: dict[int, LedgerClient] = {1: LedgerClient(1), 2: DivergingLedgerClient(2)}
    models = {1: tiny_model()}
    new, _ = train_round(strategy, clients, 1, models[1])
    assert new is not None
    models[2] = new
    new, _ = train_round(strategy, clients, 2, new, tamper=lambda n, r: truncated(r) if n == 2 else r)
    assert new is not None and set(strategy.traffic[2].rejected) == {2}
    state = clients[2].ctx.state
    sent2 = PendingUpdate.from_record(state.config_records[protocol.STATE_PENDING]).tensors
    residual2 = clients[2].residual()
    replica2 = state.array_records[protocol.STATE_REPLICA].to_torch_state_dict()
    models[3] = new
    new, log = train_round(strategy, clients, 3, new)
    assert new is not None
    reply = log.replies[2]
    assert reply.has_error() and reply.error.code == int(protocol.ErrorCode.LOCAL_UPDATE_REJECTED)
    # The round-2 update was settled (added back) before training; nothing new is pending and the
    # stored replica is the one from before this round.
    assert protocol.STATE_PENDING not in state.config_records
    recovered = clients[2].residual()
    for k in sent2:
        torch.testing.assert_close(recovered[k], residual2.get(k, torch.zeros_like(sent2[k])) + sent2[k])
    after = state.array_records[protocol.STATE_REPLICA].to_torch_state_dict()
    assert all(torch.equal(after[k], replica2[k]) for k in replica2)
    models[4] = new
    new, _ = train_round(strategy, clients, 4, new)
    assert new is not None and strategy.traffic[4].accepted == 2
    evaluate_round(strategy, clients, 4, new)
    assert _gap(clients[2], [(inner, models)]) < 2e-5


def _strip_outcome(msg: Message) -> Message:
    """The message as a protocol-1 server sends it."""
    rec = {k: v for k, v in downlink_of(msg).items() if k not in ("protocol", *protocol.UpdateOutcome._FIELDS)}
    content = RecordDict(dict(msg.content.items()))
    content[protocol.DOWNLINK] = ConfigRecord(rec)
    msg.content = content
    return msg


def test_a_pending_update_is_dropped_unread_by_a_protocol_1_downlink_or_when_unreadable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy = CompressionStrategy(RecordingFedAvg(), CompressionConfig.from_run_config({}))
    client = LedgerClient(1)
    state = client.ctx.state
    new, _ = train_round(strategy, {1: client}, 1, tiny_model(), drop=[1])  # lost: pending round 1
    assert new is None and PendingUpdate.from_record(state.config_records[protocol.STATE_PENDING]).round == 1
    residual = client.residual()
    msgs = strategy.configure_evaluate(1, record_from_tensors(tiny_model()), ConfigRecord({}), FixedGrid([1]))
    client.handle(_strip_outcome(next(iter(msgs))))
    # A protocol-1 server reports nothing: the client keeps nothing (the behaviour before protocol 2).
    assert protocol.STATE_PENDING not in state.config_records
    assert all(torch.equal(client.residual()[k], residual[k]) for k in residual)
    # An unreadable pending record (a state written for another model) is dropped with a warning.
    state[protocol.STATE_PENDING] = PendingUpdate(1, {"w1": torch.ones(3)}).to_record()
    with caplog.at_level("WARNING", logger="flwr.fedcomp"):
        train_round(strategy, {1: client}, 2, tiny_model())
    assert "dropping a pending update that cannot be read" in caplog.text
    assert "its tensors are not the model's" in caplog.text
    assert PendingUpdate.from_record(state.config_records[protocol.STATE_PENDING]).round == 2  # the new one


def test_a_server_restarted_without_records_reports_where_they_begin() -> None:
    """A wrapper that restarts at round 3 without its outcome records (only the model restored):
    the client's update of round 3 (made just before the crash) is not in the model: re-sent. One
    of round 1 whose outcome the client never heard is unknown: counted as aggregated (dropped),
    never applied twice."""
    inner = RecordingFedAvg()
    strategy = CompressionStrategy(inner, CompressionConfig.from_run_config({}))
    clients = {1: LedgerClient(1), 2: LedgerClient(2)}
    models = {1: tiny_model()}
    new, _ = train_round(strategy, clients, 1, models[1], nodes=[1, 2])
    assert new is not None
    models[2] = new
    new, _ = train_round(strategy, clients, 2, new, nodes=[1])  # node 2 sits out: pending round 1
    assert new is not None
    models[3] = new
    msgs = list(strategy.configure_train(3, record_from_tensors(new), ConfigRecord({}), FixedGrid([1])))
    clients[1].handle(msgs[0])  # node 1's round-3 update; then the server crashes
    # Node 2's round-1 update was aggregated, but the client has not heard it yet.
    assert PendingUpdate.from_record(clients[2].ctx.state.config_records[protocol.STATE_PENDING]).round == 1
    inner2 = RecordingFedAvg()
    fresh = CompressionStrategy(inner2, CompressionConfig.from_run_config({}))
    new3, log = train_round(fresh, clients, 3, new)  # the model after round 2, no records
    assert new3 is not None
    out = protocol.DownlinkHeader.from_record(log.downlinks[2]).outcome
    assert out is not None and (out.round, out.settled_round, out.records_from_round) == (3, 2, 3)
    evaluate_round(fresh, clients, 3, new3)
    assert fresh.outcome_state()["records-from-round"] == 3
    for client in clients.values():
        assert protocol.STATE_PENDING not in client.ctx.state.config_records
        assert _gap(client, [(inner, models), (inner2, {3: new})]) < 2e-5, client.node


def test_a_pending_update_is_read_only_where_it_goes_back_into_the_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    # (its tensors' record is parsed for nothing when the update was aggregated: the usual case)
    strategy = CompressionStrategy(RecordingFedAvg(), CompressionConfig.from_run_config({}))
    client = LedgerClient(1)
    real = PendingUpdate.from_record.__func__  # type: ignore[attr-defined]
    read: list[int] = []

    def counted(cls: type[PendingUpdate], rec: Any, *args: Any, **kwargs: Any) -> PendingUpdate:
        read.append(int(rec["round"]))
        return real(cls, rec, *args, **kwargs)

    monkeypatch.setattr(PendingUpdate, "from_record", classmethod(counted))
    w = tiny_model()
    for rnd in (1, 2, 3):  # each update aggregated: each pending record settled unread
        new, _ = train_round(strategy, {1: client}, rnd, w)
        assert new is not None
        w = new
    assert read == []
    new, _ = train_round(strategy, {1: client}, 4, w, drop=[1])  # lost: its pending update goes back
    assert new is None and read == []
    train_round(strategy, {1: client}, 5, w)
    assert read == [4]  # (read to be added back: the recovery itself is the tests' above)


@pytest.mark.parametrize("method", ["sbc", "stc", "topk", "deft"])
def test_the_sent_update_kept_sparsely_leaves_every_byte_and_state_record_as_dense(method: str) -> None:
    """The mod keeps its update as positions and values (``sparse_sent``): the uplink bytes, the
    residual and the pending record are those of the dense reconstruction, round after round, and
    a lost update comes back into the residual the same."""
    from fedcomp.methods.update import UpdateEncoder

    def run() -> list[tuple[bytes | None, dict[str, Any], dict[str, Any]]]:
        config = CompressionConfig.from_run_config({"uplink-codec": method})
        strategy = CompressionStrategy(RecordingFedAvg(), config)
        clients = {n: LedgerClient(n) for n in (1, 2)}
        model, seen = tiny_model(), []
        for rnd in range(1, 5):
            lose = (lambda n, r: truncated(r) if n == 2 else r) if rnd == 2 else None
            new, log = train_round(strategy, clients, rnd, model, tamper=lose)
            assert new is not None
            for n in (1, 2):
                state = clients[n].ctx.state
                seen.append((
                    protocol.UplinkReport.from_record(log.uplinks[n]).payload,
                    dict(state.config_records[protocol.STATE_PENDING]),
                    {k: v.numpy().tobytes() for k, v in tensors_from_record(state.array_records[protocol.STATE_RESIDUAL]).items()},
                ))  # fmt: skip
            model = new
        return seen

    asked: list[bool] = []
    encode_to_bytes = UpdateEncoder.encode_to_bytes

    def dense_only(self: UpdateEncoder, *args: Any, sparse_sent: bool = False, **kwargs: Any) -> bytes:
        if kwargs.get("keep_sent"):  # (the client's: the server's replica encodes its downlinks too)
            asked.append(sparse_sent)
        return encode_to_bytes(self, *args, **kwargs)

    sparse = run()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(UpdateEncoder, "encode_to_bytes", dense_only)
        dense = run()
    assert len(asked) == 8 and all(asked)  # the mod asks for it (no clipping here)
    assert len(sparse) == 8 and sparse == dense
    assert any(any(k.startswith("positions:") for k in pending) for _, pending, _ in sparse)
