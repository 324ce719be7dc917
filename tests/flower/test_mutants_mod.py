"""compression_mod details the round tests leave loose (found by mutation testing,
``scripts/mutation.sh flower``): the device setting, a method's state record, the exact resync
replies, the fields of the uplink report, error feedback switched off, the round number the
method sees, and what the mod does with the app's own errors and malformed replies."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

from fedcomp.errors import ConfigError, PayloadError
from fedcomp.flower import protocol
from fedcomp.flower.mod import MethodState, compression_mod, pick_device
from fedcomp.flower.records import record_from_tensors, tensors_from_record
from fedcomp.methods import registry
from fedcomp.methods.base import ClientRound
from fedcomp.methods.plain import SBCUplink
from tests.flower.helpers import (
    ARRAYS,
    METRICS,
    Client,
    FixedGrid,
    context,
    downlink_of,
    make_strategy,
    server_identity,  # noqa: F401 (autouse fixture)
    tiny_model,
    train_round,
    with_fields,
)


def _train_msg(strategy: Any, rnd: int = 1, node: int = 1, config: dict[str, Any] | None = None) -> Message:
    w = record_from_tensors(tiny_model())
    (msg,) = strategy.configure_train(rnd, w, ConfigRecord(config or {}), FixedGrid([node]))
    return msg


def _resync_reason(reply: Message) -> str:
    assert reply.has_error()
    assert reply.error.code == int(protocol.ErrorCode.RESYNC)
    return str(reply.error.reason)


# --- pick_device and MethodState ---------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_pick_device_without_cuda() -> None:
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError) as info:
        pick_device("cuda")
    assert str(info.value) == "client-device: 'cuda' was asked for but no CUDA device is available"


def test_pick_device_cpu_is_cpu_even_with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto") == torch.device("cuda")
    assert pick_device("cuda") == torch.device("cuda")


def test_method_state_saves_loads_and_clears_its_own_record() -> None:
    ctx = context(1)
    st = MethodState(ctx, "deft")
    assert st.load() is None
    st.clear()  # nothing to clear: no error
    st.save({"a": 1, "b": b"x"})
    assert set(ctx.state.config_records) == {"fedcomp.method.deft"}
    assert st.load() == {"a": 1, "b": b"x"}
    assert isinstance(st.load(), dict)
    other = MethodState(ctx, "gradiveq")
    assert other.load() is None
    other.save({"c": 2})
    st.clear()
    assert st.load() is None and other.load() == {"c": 2}
    assert set(ctx.state.config_records) == {"fedcomp.method.gradiveq"}


# --- resync replies ------------------------------------------------------------------------------------


def test_a_malformed_downlink_record_asks_for_a_resync_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    strategy, client = make_strategy(), Client(1)
    msg = _train_msg(strategy)
    msg.content[protocol.DOWNLINK] = with_fields(downlink_of(msg), drop=["digest"])
    with caplog.at_level(logging.WARNING):
        reply = client.handle(msg)
    reason = "payload: downlink: field 'digest' is missing"
    assert _resync_reason(reply) == f"fedcomp resync needed: {reason}"
    assert client.calls == 0
    assert f"fedcomp: {reason}; asking for a full resync" in [r.getMessage() for r in caplog.records]


def test_an_unknown_uplink_method_asks_for_a_resync() -> None:
    strategy, client = make_strategy(), Client(1)
    msg = _train_msg(strategy)
    msg.content[protocol.DOWNLINK] = with_fields(downlink_of(msg), uplink_method="no-such-method")
    reason = _resync_reason(client.handle(msg))
    assert reason.startswith("fedcomp resync needed: uplink-codec: unknown uplink method 'no-such-method'")
    assert client.calls == 0


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"payloads": []}, "payload: a full resync carries exactly one payload"),
        ("two", "payload: a full resync carries exactly one payload"),
        ({"version": 3}, "payload: full replica is version 0, expected 3"),
        ({"mode": "none"}, "payload: no replica after the downlink"),
        ({"mode": "chain"}, "payload: a delta chain was sent but this client holds no replica"),
    ],
)
def test_full_downlink_failures_name_the_reason(change: Any, reason: str) -> None:
    strategy, client = make_strategy(), Client(1)
    msg = _train_msg(strategy)
    dl = downlink_of(msg)
    if change == "two":
        change = {"payloads": list(dl["payloads"]) * 2}  # type: ignore[call-overload]
    msg.content[protocol.DOWNLINK] = with_fields(dl, **change)
    assert _resync_reason(client.handle(msg)) == f"fedcomp resync needed: {reason}"
    assert client.calls == 0
    assert protocol.STATE_REPLICA not in client.ctx.state
    assert protocol.STATE_META not in client.ctx.state


def test_a_digest_mismatch_names_both_digests() -> None:
    strategy, client = make_strategy(), Client(1)
    msg = _train_msg(strategy)
    dl = downlink_of(msg)
    good = str(dl["digest"])
    msg.content[protocol.DOWNLINK] = with_fields(dl, digest="0" * 32)
    reason = _resync_reason(client.handle(msg))
    assert (
        reason == f"fedcomp resync needed: payload: replica digest {good} after the downlink, the server has {'0' * 32}"
    )


def test_a_method_that_rejects_its_downlink_bytes_asks_for_a_resync(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    forgotten: list[Any] = []

    class Picky(SBCUplink):
        @classmethod
        def client_receive(cls, rnd: ClientRound) -> None:
            raise PayloadError("", "bad allocation")

        @classmethod
        def client_forget(cls, state: Any) -> None:
            forgotten.append(state)
            super().client_forget(state)

    monkeypatch.setitem(registry.UPLINKS, "sbc", Picky)
    strategy, client = make_strategy(), Client(1)
    client.ctx.state["fedcomp.method.sbc"] = ConfigRecord({"x": 1})
    with caplog.at_level(logging.WARNING):
        reply = client.handle(_train_msg(strategy))
    assert _resync_reason(reply) == "fedcomp: payload: bad allocation"
    assert client.calls == 0
    assert len(forgotten) == 1 and "fedcomp.method.sbc" not in client.ctx.state
    # The replica itself was fine and is kept (only the method's state is dropped).
    assert protocol.STATE_REPLICA in client.ctx.state.array_records
    assert "fedcomp: payload: bad allocation" in [r.getMessage() for r in caplog.records]


# --- what the method sees ------------------------------------------------------------------------------


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[ClientRound]:
    seen: list[ClientRound] = []

    class Spy(SBCUplink):
        @classmethod
        def client_receive(cls, rnd: ClientRound) -> None:
            seen.append(rnd)

    monkeypatch.setitem(registry.UPLINKS, "sbc", Spy)
    return seen


@pytest.mark.parametrize(("value", "expected"), [(4, 4), (True, None), ("4", None), (None, None)])
def test_the_method_sees_the_round_number_only_when_it_is_an_int(
    monkeypatch: pytest.MonkeyPatch, value: Any, expected: Any
) -> None:
    seen = _spy(monkeypatch)
    strategy, client = make_strategy(**{"min-compress-numel": 500}), Client(1)
    msg = _train_msg(strategy, rnd=4)
    config = dict(msg.content.config_records["config"])
    if value is None:
        del config[protocol.SERVER_ROUND]
    else:
        config[protocol.SERVER_ROUND] = value
    msg.content["config"] = ConfigRecord(config)
    client.app = lambda m, c: _train_app(m)  # type: ignore[method-assign]
    reply = client.handle(msg)
    assert not reply.has_error()
    (rnd,) = seen
    assert rnd.server_round == expected
    assert rnd.min_numel == 500
    assert rnd.codec_config == strategy.uplink.round_codec_config(4)
    assert dict(rnd.extras) == {}
    assert set(rnd.replica) == set(tiny_model())
    assert rnd.state.load() is None


def test_without_a_train_config_the_round_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy(monkeypatch)
    strategy, client = make_strategy(), Client(1)
    msg = _train_msg(strategy)
    del msg.content["config"]
    reply = compression_mod(msg, client.ctx, lambda m, c: _train_app(m))
    assert not reply.has_error()
    assert seen[0].server_round is None


def _train_app(msg: Message, arrays: str = ARRAYS) -> Message:
    got = tensors_from_record(msg.content.array_records[arrays])
    trained = {k: v + 0.01 for k, v in got.items()}
    return Message(
        RecordDict({arrays: record_from_tensors(trained), METRICS: MetricRecord({"num-examples": 3})}), reply_to=msg
    )


# --- the reply ----------------------------------------------------------------------------------------


def test_the_train_reply_replaces_the_model_by_the_uplink_report() -> None:
    strategy, client = make_strategy(**{"client-device": "cpu"}), Client(1)
    reply = compression_mod(_train_msg(strategy), client.ctx, lambda m, c: _train_app(m))
    assert not reply.has_error()
    assert ARRAYS not in reply.content.array_records  # the trained model is not sent
    assert reply.content.metric_records[METRICS]["num-examples"] == 3  # the app's own records pass
    report = protocol.UplinkReport.from_record(reply.content.config_records[protocol.UPLINK])
    assert report.device == "cpu"
    assert report.payload
    assert report.encode_seconds is not None and report.encode_seconds > 0
    assert report.train_seconds is not None and report.train_seconds > 0
    assert report.replica_version == 0
    assert report.status == {}
    # Diagnostics: the norms of the update the app made (0.01 everywhere) and of the residual kept.
    n = sum(t.numel() for t in tiny_model().values())
    assert report.update_norm == pytest.approx(0.01 * n**0.5, rel=1e-5)
    residual = tensors_from_record(client.ctx.state.array_records[protocol.STATE_RESIDUAL])
    expected = sum(float(t.double().pow(2).sum()) for t in residual.values()) ** 0.5
    assert report.residual_norm == pytest.approx(expected, rel=1e-9)
    assert 0.0 < report.residual_norm < report.update_norm


def test_an_app_error_is_returned_as_is_and_the_replica_is_kept() -> None:
    strategy, client = make_strategy(), Client(1)

    def crash(msg: Message, ctx: Any) -> Message:
        return Message(Error(code=42, reason="out of memory"), reply_to=msg)

    reply = compression_mod(_train_msg(strategy), client.ctx, crash)
    assert reply.has_error() and reply.error.code == 42 and reply.error.reason == "out of memory"
    # The downlink was applied and saved: the next round needs no full replica.
    assert protocol.STATE_REPLICA in client.ctx.state.array_records
    meta = protocol.ReplicaMeta.from_record(client.ctx.state.config_records[protocol.STATE_META])
    assert meta.version == 0


def test_a_train_reply_without_the_model_is_a_configuration_error() -> None:
    strategy, client = make_strategy(), Client(1)

    def no_model(msg: Message, ctx: Any) -> Message:
        return Message(RecordDict({METRICS: MetricRecord({"num-examples": 1})}), reply_to=msg)

    with pytest.raises(ConfigError) as info:
        compression_mod(_train_msg(strategy), client.ctx, no_model)
    assert str(info.value).startswith("the ClientApp's train reply has no ArrayRecord 'arrays' (it has none): ")

    def other_name(msg: Message, ctx: Any) -> Message:
        model = msg.content.array_records["arrays"]
        return Message(RecordDict({"model": model, METRICS: MetricRecord({"num-examples": 1})}), reply_to=msg)

    with pytest.raises(ConfigError) as info:
        compression_mod(_train_msg(strategy), client.ctx, other_name)
    assert str(info.value).startswith("the ClientApp's train reply has no ArrayRecord 'arrays' (it has ['model']): ")
    assert "arrayrecord_key = 'arrays'" in str(info.value)


def test_without_error_feedback_no_residual_is_kept() -> None:
    strategy, client = make_strategy(**{"error-feedback": False}), Client(1)
    w = tiny_model()
    for r in (1, 2):
        w_next, _ = train_round(strategy, {1: client}, r, w)
        assert w_next is not None
        w = w_next
    residual = tensors_from_record(client.ctx.state.array_records[protocol.STATE_RESIDUAL])
    assert all(float(t.abs().sum()) == 0.0 for t in residual.values())
    # ... while with error feedback (the default) there is one.
    strategy2, client2 = make_strategy(), Client(1)
    train_round(strategy2, {1: client2}, 1, tiny_model())
    residual2 = tensors_from_record(client2.ctx.state.array_records[protocol.STATE_RESIDUAL])
    assert sum(float(t.abs().sum()) for t in residual2.values()) > 0


def test_evaluate_replies_report_the_replica_and_the_method_status(monkeypatch: pytest.MonkeyPatch) -> None:
    class Status(SBCUplink):
        @classmethod
        def client_status(cls, state: Any) -> dict[str, int]:
            return {"sbc.version": 9}

    monkeypatch.setitem(registry.UPLINKS, "sbc", Status)
    strategy, client = make_strategy(), Client(1)
    w = record_from_tensors(tiny_model())
    (msg,) = strategy.configure_evaluate(1, w, ConfigRecord({}), FixedGrid([1]))
    reply = client.handle(msg)
    assert not reply.has_error()
    assert msg.metadata.message_type == MessageType.EVALUATE
    report = protocol.UplinkReport.from_record(reply.content.config_records[protocol.UPLINK])
    assert strategy.replica is not None
    assert (report.replica_version, report.replica_digest) == (0, strategy.replica.digest)
    assert report.payload is None and report.status == {"sbc.version": 9}
    assert report.sbc_p is None and report.local_iters is None and report.link is None
    assert "loss" in reply.content.metric_records[METRICS]
    # Train replies carry the status too.
    train = client.handle(_train_msg(strategy))
    assert protocol.UplinkReport.from_record(train.content.config_records[protocol.UPLINK]).status == {"sbc.version": 9}


def test_the_mod_remembers_the_fastest_seconds_per_local_iteration() -> None:
    strategy, client = make_strategy(**{"local-iters": 4}), Client(1)
    w = tiny_model()
    measured = []
    for r in (1, 2, 3):
        w_next, log = train_round(strategy, {1: client}, r, w)
        report = protocol.UplinkReport.from_record(log.uplinks[1])
        assert report.local_iters == 4 and report.train_seconds is not None
        measured.append(report.train_seconds / 4)
        stored = protocol.measured_seconds_per_iter(client.ctx.state.config_records[protocol.STATE_BANDWIDTH])
        assert stored == pytest.approx(min(measured), rel=1e-12)
        assert w_next is not None
        w = w_next


def test_with_a_budget_the_policys_estimate_is_reported() -> None:
    strategy, client = make_strategy(**{"uplink-budget-bytes": 3000, "link-profiles": "10,10,20"}), Client(1)
    _, log = train_round(strategy, {1: client}, 1, tiny_model())
    report = protocol.UplinkReport.from_record(log.uplinks[1])
    assert isinstance(report.estimated_bytes, int) and report.estimated_bytes > 0
    assert report.payload is not None
    assert abs(report.estimated_bytes - len(report.payload)) < 0.5 * len(report.payload)
    assert report.budget_bytes == 3000 and report.fits is True
    assert strategy.traffic[1].estimated_bytes == {1: report.estimated_bytes}
