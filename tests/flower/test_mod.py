"""compression_mod over several rounds, with downlinks built by a real CompressionStrategy and a
ClientApp that "trains" by adding a known delta: the residual is carried in ``context.state``,
the replica digest is checked, and every failure to rebuild the model asks for a resync."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ConfigRecord, Context, Message, MessageType, RecordDict

from fedcomp.flower import protocol
from fedcomp.flower.mod import compression_mod
from fedcomp.flower.records import digest, record_from_tensors, tensors_from_record
from fedcomp.flower.strategy import CompressionStrategy
from fedcomp.wire.serde import update_from_bytes
from tests.flower.helpers import (
    Client,
    FixedGrid,
    context,
    decode_payload,
    downlink_of,
    evaluate_round,
    make_strategy,
    max_abs_diff,
    mode_of,
    payloads_of,
    server_identity,  # noqa: F401 (autouse fixture)
    tiny_model,
    train_round,
    with_fields,
)

ROUNDS = 5


def _run(rounds: int, carry_residual: bool = True) -> tuple[CompressionStrategy, Client, list[bytes]]:
    """One client through ``rounds`` train rounds; returns its uplink payloads in order."""
    strategy, client = make_strategy(), Client(1)
    w = tiny_model()
    sent = []
    for r in range(1, rounds + 1):
        if not carry_residual and protocol.STATE_RESIDUAL in client.ctx.state:
            del client.ctx.state[protocol.STATE_RESIDUAL]
        w_next, log = train_round(strategy, {1: client}, r, w)
        assert w_next is not None and strategy.traffic[r].rejected == {}
        report = protocol.UplinkReport.from_record(log.uplinks[1])
        assert report.payload is not None
        sent.append(report.payload)
        w = w_next
    return strategy, client, sent


def _residual(client: Client) -> dict[str, torch.Tensor]:
    rec = client.ctx.state.array_records.get(protocol.STATE_RESIDUAL)
    return tensors_from_record(rec) if rec is not None else {}


@pytest.mark.parametrize("carry", [True, False], ids=["carried", "dropped-between-rounds"])
def test_the_residual_is_carried_across_rounds(carry: bool) -> None:
    strategy, client, sent = _run(ROUNDS, carry_residual=carry)
    model = tiny_model()
    decoded = [decode_payload(p, model, strategy.config.uplink_codec_at(r)) for r, p in enumerate(sent, start=1)]
    local = [client.seen[r][1] for r in range(1, ROUNDS + 1)]
    residual = _residual(client)
    total_sent = {k: sum(d[k] for d in decoded) for k in model}
    total_local = {k: sum(d[k] for d in local) for k in model}
    lhs = {k: total_sent[k] + residual.get(k, torch.zeros_like(model[k])) for k in model}
    if carry:
        # sum(sent) + final residual == sum(local deltas): nothing is lost, only delayed.
        for k in model:
            torch.testing.assert_close(lhs[k], total_local[k], rtol=0, atol=1e-5)
        # ... and the check is not vacuous: SBC dropped most of each update into the residual.
        assert max_abs_diff(decoded[-1], local[-1]) > 1e-3
        assert float(residual["w1"].norm()) > 0.5 * float(total_local["w1"].norm())
        # Small tensors go dense: no residual, sent exactly.
        torch.testing.assert_close(total_sent["b"], total_local["b"], rtol=0, atol=1e-6)
    else:
        # A residual that does not survive between rounds loses what earlier rounds did not send.
        assert max_abs_diff(lhs, total_local) > 1e-3


def test_the_uplink_reports_the_replica_it_trained_on() -> None:
    strategy, client = make_strategy(), Client(1)
    w = tiny_model()
    for r in (1, 2, 3):
        w_next, log = train_round(strategy, {1: client}, r, w)
        assert strategy.replica is not None
        report = protocol.UplinkReport.from_record(log.uplinks[1])
        assert report.replica_version == strategy.replica.version == r - 1
        assert report.replica_digest == strategy.replica.digest
        assert report.payload is not None
        assert update_from_bytes(report.payload).base_model_version == strategy.replica.version
        # The model the app was given is the server's replica, bit for bit.
        received = client.seen[r][0]
        assert digest(received) == strategy.replica.digest
        assert all(torch.equal(received[k], strategy.replica.tensors[k]) for k in received)
        assert w_next is not None
        w = w_next
    # Evaluate replies report the replica too (no payload).
    _, log = evaluate_round(strategy, {1: client}, 3, w)
    reply = log.replies[1]
    assert not reply.has_error()
    report = protocol.UplinkReport.from_record(reply.content.config_records[protocol.UPLINK])
    assert (report.replica_version, report.replica_digest) == (strategy.replica.version, strategy.replica.digest)
    assert report.replica_version == 3 and report.payload is None


def _assert_resync(reply: Message, client: Client, calls_before: int) -> None:
    assert reply.has_error(), "the mod accepted a model it could not rebuild"
    assert reply.error.code == protocol.ErrorCode.RESYNC
    assert reply.error.reason
    assert client.calls == calls_before, "the app ran on a model the client could not verify"
    assert protocol.STATE_REPLICA not in client.ctx.state.array_records, "the mod kept a replica it distrusts"


def _recovers(strategy: CompressionStrategy, client: Client, rnd: int, w: dict[str, torch.Tensor]) -> None:
    """After a resync error the server sends the full replica and the client is back in sync."""
    _, log = train_round(strategy, {client.node: client}, rnd, w)
    assert mode_of(log.downlinks[client.node]) == "full"
    assert not log.replies[client.node].has_error()
    assert strategy.traffic[rnd].rejected == {}
    report = protocol.UplinkReport.from_record(log.uplinks[client.node])
    assert strategy.replica is not None and report.replica_digest == strategy.replica.digest


def _two_rounds(strategy: CompressionStrategy, client: Client) -> dict[str, torch.Tensor]:
    w = tiny_model()
    for r in (1, 2):
        w_next, _ = train_round(strategy, {client.node: client}, r, w)
        assert w_next is not None
        w = w_next
    return w


@pytest.mark.parametrize("next_message", ["train-chain", "evaluate-chain", "train-none"])
def test_a_corrupted_stored_replica_asks_for_a_resync(next_message: str) -> None:
    strategy, client = make_strategy(), Client(1)
    w = _two_rounds(strategy, client)
    if next_message == "train-none":
        # Bring the client to the current replica first, so that the next downlink is "none".
        evaluate_round(strategy, {1: client}, 2, w)
    # One value of the replica kept in context.state changes (disk corruption, a buggy app...).
    stored = tensors_from_record(client.ctx.state.array_records[protocol.STATE_REPLICA])
    stored["w1"][3, 4] += 1e-3
    client.ctx.state[protocol.STATE_REPLICA] = record_from_tensors(stored)
    calls = client.calls
    if next_message == "evaluate-chain":
        _, log = evaluate_round(strategy, {1: client}, 2, w)
        expected_mode = "chain"
    else:
        _, log = train_round(strategy, {1: client}, 3, w)
        expected_mode = "none" if next_message == "train-none" else "chain"
    assert mode_of(log.downlinks[1]) == expected_mode
    _assert_resync(log.replies[1], client, calls)
    _recovers(strategy, client, 4, w)


def _first_downlink(strategy: CompressionStrategy, rnd: int, w: dict[str, torch.Tensor], node: int) -> Message:
    (msg,) = strategy.configure_train(rnd, record_from_tensors(w), ConfigRecord({}), FixedGrid([node]))
    return msg


@pytest.mark.parametrize("mode", ["full", "chain"])
def test_a_downlink_whose_digest_does_not_match_asks_for_a_resync(mode: str) -> None:
    strategy, client = make_strategy(), Client(1)
    w = tiny_model()
    rnd = 1
    if mode == "chain":
        w, rnd = _two_rounds(strategy, client), 3
    msg = _first_downlink(strategy, rnd, w, 1)
    dl = downlink_of(msg)
    assert mode_of(dl) == mode
    # The server claims another replica than the one its payloads build.
    msg.content[protocol.DOWNLINK] = with_fields(dl, digest="f" * len(str(dl["digest"])))
    calls = client.calls
    reply = client.handle(msg)
    _assert_resync(reply, client, calls)
    # The server forgets the client and the next round brings it back with a full replica.
    strategy.aggregate_train(rnd, [reply])
    _recovers(strategy, client, rnd + 1, w)


def test_a_corrupted_full_payload_asks_for_a_resync() -> None:
    strategy, client = make_strategy(), Client(1)
    w = tiny_model()
    msg = _first_downlink(strategy, 1, w, 1)
    dl = downlink_of(msg)
    (full,) = payloads_of(dl)
    # Change one float of the model inside the dense payload (the last bytes are w's bias data).
    bad = bytearray(full)
    bad[-3] ^= 0x01
    msg.content[protocol.DOWNLINK] = with_fields(dl, payloads=[bytes(bad)])
    calls = client.calls
    _assert_resync(client.handle(msg), client, calls)


def test_a_chain_to_a_client_without_a_replica_asks_for_a_resync() -> None:
    strategy, client = make_strategy(), Client(1)
    w = _two_rounds(strategy, client)
    # The client lost its state (a new machine with the same node id); the server does not know.
    client.ctx = context(1)
    calls = client.calls
    _, log = train_round(strategy, {1: client}, 3, w)
    assert mode_of(log.downlinks[1]) == "chain"
    _assert_resync(log.replies[1], client, calls)
    _recovers(strategy, client, 4, w)


def test_a_chain_sent_by_hand_with_no_replica_asks_for_a_resync() -> None:
    # The same, with the chain moved onto a client that never had a replica.
    strategy, client = make_strategy(), Client(1)
    w = _two_rounds(strategy, client)
    msg = _first_downlink(strategy, 3, w, 1)
    assert mode_of(downlink_of(msg)) == "chain"
    fresh = Client(2)
    _assert_resync(compression_mod(msg, fresh.ctx, fresh.app), fresh, 0)


def test_messages_without_a_downlink_pass_through() -> None:
    client = Client(1)
    model = tiny_model()
    msg = Message(
        RecordDict({"arrays": record_from_tensors(model), "config": ConfigRecord({"server-round": 1})}),
        message_type=MessageType.TRAIN,
        dst_node_id=1,
    )
    reply = compression_mod(msg, client.ctx, client.app)
    assert client.calls == 1 and not reply.has_error()
    assert protocol.UPLINK not in reply.content.config_records
    trained = tensors_from_record(reply.content.array_records["arrays"])
    assert torch.equal(trained["w1"], model["w1"] + client.seen[1][1]["w1"])
    assert len(client.ctx.state) == 0


def test_each_client_keeps_its_own_state() -> None:
    strategy = make_strategy()
    clients = {n: Client(n) for n in (1, 2)}
    w = tiny_model()
    for r in (1, 2):
        w_next, _ = train_round(strategy, clients, r, w)
        assert w_next is not None
        w = w_next
    res1, res2 = (tensors_from_record(c.ctx.state.array_records[protocol.STATE_RESIDUAL]) for c in clients.values())
    assert not torch.equal(res1["w1"], res2["w1"])


class _Destructive(Client):
    """A ClientApp that takes the model out of its record (Flower's ``keep_input=False``) and
    leaves junk in its place, before it trains."""

    def app(self, msg: Message, ctx: Context) -> Message:
        rec = msg.content.array_records["arrays"]
        self.given = tensors_from_record(rec)
        rec.to_torch_state_dict(keep_input=False)  # (pops every Array)
        rec["junk"] = Array(np.zeros(3, dtype=np.float32))
        msg.content.array_records["arrays"] = record_from_tensors(self.kept_model)
        return super().app(msg, ctx)


def test_what_the_client_app_does_to_its_record_leaves_the_stored_replica_be() -> None:
    # The mod stores the record it made for the ClientApp's model (one record a message): the
    # app gets a copy of it.
    strategy, client = make_strategy(), _Destructive(1)
    w = tiny_model()
    for r in (1, 2, 3):
        client.kept_model = {k: v.clone() for k, v in w.items()}  # (what the app trains from)
        w_next, log = train_round(strategy, {1: client}, r, w)
        assert w_next is not None and not log.replies[1].has_error()
        stored = tensors_from_record(client.ctx.state.array_records[protocol.STATE_REPLICA])
        assert list(stored) == list(w) and digest(stored) == digest(client.given) == strategy.replica.digest
        w = w_next
    # and a downlink of "none" (the replica as stored) hands the app the stored record's values
    for _ in range(2):
        _, log = evaluate_round(strategy, {1: client}, 3, w)
        assert not log.replies[1].has_error()
        assert digest(client.given) == strategy.replica.digest
    assert mode_of(log.downlinks[1]) == "none"


class _FrozenW1(Client):
    """A client that fine-tunes all but ``w1`` (a frozen layer: its update is exactly zero)."""

    def replied(self, received: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**trained, "w1": received["w1"].clone()}


def test_a_frozen_layer_costs_no_positions_and_stays_bit_identical() -> None:
    """Through the real mod and strategy, two clients, several rounds: the frozen tensor's SBC
    payload has no positions (its mean is 0), the global model's copy of it never moves, not by
    a bit, and the client keeps no residual for it; the trained tensors still move."""
    strategy = make_strategy(**{"sbc-p": 0.05})
    clients = {1: _FrozenW1(1), 2: _FrozenW1(2)}
    w0 = tiny_model()
    w = w0
    for r in range(1, 4):
        w_next, log = train_round(strategy, clients, r, w)
        assert w_next is not None and strategy.traffic[r].rejected == {}
        for node in clients:
            report = protocol.UplinkReport.from_record(log.uplinks[node])
            assert report.payload is not None
            by_name = {t.name: t for t in update_from_bytes(report.payload).tensors}
            assert by_name["w1"].payload.nnz == 0 and by_name["w1"].payload.bits == b""
            assert by_name["w2"].payload.nnz == round(0.05 * 1200)
        w = w_next
    assert torch.equal(w["w1"], w0["w1"]) and not torch.equal(w["w2"], w0["w2"])
    for client in clients.values():
        rec = client.ctx.state.array_records.get(protocol.STATE_RESIDUAL)
        residual = tensors_from_record(rec) if rec is not None else {}
        assert "w1" not in residual or not residual["w1"].any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_a_float16_or_float64_model_trains_and_the_global_model_comes_back_float32(dtype: torch.dtype) -> None:
    """What the README says: compression works in float32; a model of another float dtype is
    accepted as it is and the wrapper returns a float32 global model, the same as for the model
    cast to float32 first (its values are exact in float32, so the runs are bit-identical)."""
    results = []
    for model_dtype in (dtype, torch.float32):
        strategy, clients = make_strategy(), {1: Client(1), 2: Client(2)}
        w = {k: v.to(torch.float16).to(model_dtype) for k, v in tiny_model().items()}
        for r in range(1, 3):
            w_next, _ = train_round(strategy, clients, r, w)
            assert w_next is not None and strategy.traffic[r].rejected == {}
            assert {v.dtype for v in w_next.values()} == {torch.float32}
            w = w_next
        results.append(w)
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[1])


def test_a_plain_train_message_passes_through_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A mod whose server has no wrapper ran dense without a word (an own-app audit)."""
    from fedcomp.flower import mod as mod_module

    monkeypatch.setattr(mod_module, "_said_plain", False)
    model = record_from_tensors(tiny_model())
    seen = []

    def app(msg: Message, ctx: Context) -> Message:
        seen.append(msg)
        return Message(RecordDict({"arrays": msg.content.array_records["arrays"]}), reply_to=msg)

    def plain(kind: str) -> Message:
        return Message(RecordDict({"arrays": model, "config": ConfigRecord({})}), dst_node_id=1, message_type=kind)

    with caplog.at_level("INFO", logger="flwr"):
        compression_mod(plain(MessageType.QUERY), context(1), app)
        assert "passes through uncompressed" not in caplog.text  # (a query is no round's traffic)
        for _ in range(3):
            reply = compression_mod(plain(MessageType.TRAIN), context(1), app)
            assert protocol.UPLINK not in reply.content.config_records
    assert len(seen) == 4 and all(m.content.array_records["arrays"] is model for m in seen)
    assert caplog.text.count("passes through uncompressed (the server's strategy is not wrapped") == 1
