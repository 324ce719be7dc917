"""CompressionStrategy details the end-to-end tests leave loose (found by mutation testing,
``scripts/mutation.sh flower``): the ``fedcomp.*`` figures and the round log line, the train
config it adds, the record names it takes from the inner strategy, the downlink fields taken
from the config, when the replica advances, a decoder that fails unexpectedly, the ``finish``
hook, and the small public helpers."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvg, FedMedian, FedProx, Strategy

from fedcomp.flower import protocol
from fedcomp.flower.records import record_from_tensors, tensors_from_record
from fedcomp.flower.settings import CompressionConfig
from fedcomp.flower.strategy import CompressionStrategy, aggregates_by_weighted_mean
from fedcomp.flower.traffic import metric_record
from fedcomp.methods.plain import SBCUplink
from tests.flower.helpers import (
    ARRAYS,
    METRICS,
    SAMPLE_ALL,
    Client,
    FixedGrid,
    context,
    downlink_of,
    evaluate_round,
    make_strategy,
    server_identity,  # noqa: F401 (autouse fixture)
    tiny_model,
    train_round,
)

NODES = (1, 2)


def _clients() -> dict[int, Client]:
    return {n: Client(n) for n in NODES}


# --- figures and the round log ---------------------------------------------------------------------


def _aggregate(strategy: CompressionStrategy, rnd: int, w: dict[str, torch.Tensor], clients: dict[int, Client]):
    msgs = list(strategy.configure_train(rnd, record_from_tensors(w), ConfigRecord({}), FixedGrid(sorted(clients))))
    replies = [clients[m.metadata.dst_node_id].handle(m) for m in msgs]
    return strategy.aggregate_train(rnd, replies)


def test_train_metrics_are_the_inner_ones_plus_this_rounds_figures(caplog: pytest.LogCaptureFixture) -> None:
    strategy, clients = make_strategy(), _clients()
    w = tiny_model()
    arrays, _ = _aggregate(strategy, 1, w, clients)
    assert arrays is not None
    w2 = tensors_from_record(arrays)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flwr.fedcomp"):
        _, metrics = _aggregate(strategy, 2, w2, clients)
    assert isinstance(metrics, MetricRecord)
    figures = metric_record(strategy.traffic[2], strategy.traffic)
    assert {k: metrics[k] for k in metrics if k.startswith("fedcomp.")} == figures
    assert set(figures) <= set(metrics) and len(figures) >= 13
    # The run totals cover round 1 too.
    assert figures["fedcomp.total-bytes"] > figures["fedcomp.uplink-bytes"] + figures["fedcomp.downlink-bytes"]
    assert figures["fedcomp.replies-accepted"] == 2 and figures["fedcomp.replies-rejected"] == 0
    assert figures["fedcomp.server-codec-seconds"] > 0  # the replica advanced and two replies decoded
    assert figures["fedcomp.client-encode-seconds"] > 0
    # One log line for the train round, with its figures.
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("fedcomp:") and "round 2" in r.getMessage()
    ]
    assert lines == [
        f"fedcomp: round 2: uplink {figures['fedcomp.uplink-bytes']} B (x{figures['fedcomp.uplink-ratio']:.1f}), "
        f"downlink {figures['fedcomp.downlink-bytes']} B (x{figures['fedcomp.downlink-ratio']:.1f}), "
        "2 replies accepted, 0 rejected, 0 failed"
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.getMessage().startswith("fedcomp:"))


def test_a_train_round_after_an_evaluate_round_sends_no_downlink_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """The evaluate round carried round 1's model to every client, so round 2's train messages
    carry none: 0 bytes, ratio 0 (as documented), and a log line that says why, not "x0.0"."""
    strategy, clients = make_strategy(), _clients()
    w1, _ = train_round(strategy, clients, 1, tiny_model())
    assert w1 is not None
    evaluate_round(strategy, clients, 1, w1)
    with caplog.at_level(logging.INFO, logger="flwr.fedcomp"):
        w2, log = train_round(strategy, clients, 2, w1)
    assert w2 is not None and {str(rec["mode"]) for rec in log.downlinks.values()} == {"none"}
    figures = metric_record(strategy.traffic[2], strategy.traffic)
    assert (figures["fedcomp.downlink-bytes"], figures["fedcomp.downlink-ratio"]) == (0, 0.0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fedcomp: round 2:")]
    assert len(lines) == 1 and ", downlink 0 B (clients up to date), 2 replies accepted" in lines[0]


def test_the_apps_own_local_iters_is_kept_and_the_schedule_fills_it_in_otherwise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy = make_strategy(**{"local-iters": "list:10,5"})
    model = record_from_tensors(tiny_model())
    with caplog.at_level(logging.WARNING, logger="flwr.fedcomp"):
        for rnd, own, sent in ((1, None, 10), (2, None, 5), (1, 1, 1), (2, 3, 3), (2, 5, 5)):
            config = ConfigRecord({"lr": 0.1} if own is None else {"lr": 0.1, protocol.LOCAL_ITERS: own})
            msgs = list(strategy.configure_train(rnd, model, config, FixedGrid(NODES)))
            assert {int(m.content.config_records["config"][protocol.LOCAL_ITERS]) for m in msgs} == {sent}  # type: ignore[arg-type]
    warned = [r.getMessage() for r in caplog.records if "local-iters" in r.getMessage()]
    assert len(warned) == 1 and "= 1 is sent as it is" in warned[0] and "(10 in round 1)" in warned[0]


def test_compress_false_is_the_inner_strategy_with_the_mod_passing_through() -> None:
    """``compress = false`` in the config makes the wrapper the inner strategy: the same
    messages (no fedcomp records), the same model as plain FedAvg, no figures."""
    plain, wrapped = FedAvg(**SAMPLE_ALL), make_strategy(compress=False)
    wrapped.strategy = FedAvg(**SAMPLE_ALL)
    clients = {n: Client(n) for n in NODES}
    model = record_from_tensors(tiny_model())
    msgs = list(wrapped.configure_train(1, model, ConfigRecord({"lr": 0.1}), FixedGrid(NODES)))
    ref = list(plain.configure_train(1, model, ConfigRecord({"lr": 0.1}), FixedGrid(NODES)))
    assert [dict(m.content.config_records) for m in msgs] == [dict(m.content.config_records) for m in ref]
    assert all(protocol.DOWNLINK not in m.content.config_records for m in msgs)
    replies = [clients[m.metadata.dst_node_id].handle(m) for m in msgs]  # through compression_mod
    assert all(protocol.UPLINK not in r.content.config_records for r in replies)
    got, _ = wrapped.aggregate_train(1, replies)
    want, _ = plain.aggregate_train(1, replies)
    assert got is not None and want is not None
    assert all(torch.equal(a, b) for a, b in zip(tensors_from_record(got).values(), tensors_from_record(want).values()))
    assert wrapped.traffic == {} and wrapped.replica is None


def test_inner_train_metrics_are_kept() -> None:
    def aggr(contents: list[RecordDict], key: str) -> MetricRecord:
        return MetricRecord({"inner-metric": 7.5, "replies": len(contents)})

    inner = FedAvg(min_train_nodes=1, min_available_nodes=1, train_metrics_aggr_fn=aggr)
    strategy, clients = CompressionStrategy(inner, CompressionConfig()), _clients()
    _, metrics = _aggregate(strategy, 1, tiny_model(), clients)
    assert metrics is not None
    assert metrics["inner-metric"] == 7.5 and metrics["replies"] == 2
    assert metrics["fedcomp.replies-accepted"] == 2


def test_evaluate_metrics_carry_the_figures_and_no_log_line(caplog: pytest.LogCaptureFixture) -> None:
    strategy, clients = make_strategy(), _clients()
    w = tiny_model()
    train_round(strategy, clients, 1, w)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flwr.fedcomp"):
        metrics, _ = evaluate_round(strategy, clients, 1, w)
    assert isinstance(metrics, MetricRecord)
    assert "loss" in metrics  # the inner strategy's own
    assert {k: metrics[k] for k in metrics if k.startswith("fedcomp.")} == metric_record(
        strategy.traffic[1], strategy.traffic
    )
    assert not [r for r in caplog.records if r.getMessage().startswith("fedcomp:") and "uplink" in r.getMessage()]


def test_no_evaluate_metrics_stay_none() -> None:
    strategy, clients = make_strategy(), _clients()
    w = tiny_model()
    train_round(strategy, clients, 1, w)
    assert strategy.aggregate_evaluate(1, []) is None


def test_evaluate_replies_update_what_the_server_knows_of_each_client() -> None:
    strategy, clients = make_strategy(**{"delta-log-size": 0}), _clients()
    w = tiny_model()
    w1, _ = train_round(strategy, clients, 1, w)
    assert w1 is not None
    # The evaluate round brings both clients to version 1 (full: no log); if the server did not
    # note their replies it would send the full replica again in round 2.
    evaluate_round(strategy, clients, 1, w1)
    train_round(strategy, clients, 2, w1)
    assert strategy.traffic[2].downlink_mode == {1: "none", 2: "none"}


# --- what the wrapper sends --------------------------------------------------------------------------


def test_the_train_config_gets_this_rounds_local_iterations() -> None:
    strategy = make_strategy(**{"local-iters": "list:3,5"})
    w = record_from_tensors(tiny_model())
    config = ConfigRecord({"lr": 0.1})
    for rnd, iters in ((1, 3), (2, 5)):
        (msg,) = strategy.configure_train(rnd, w, config, FixedGrid([1]))
        sent = msg.content.config_records["config"]
        assert sent[protocol.LOCAL_ITERS] == iters and sent["lr"] == 0.1
        assert sent[protocol.SERVER_ROUND] == rnd
    assert dict(config) == {"lr": 0.1}  # the caller's record is not changed


def test_the_downlink_carries_the_configured_settings() -> None:
    strategy = make_strategy(
        **{"error-feedback": False, "min-compress-numel": 500, "client-device": "cpu", "round-deadline-s": 3.0}
    )
    (msg,) = strategy.configure_train(1, record_from_tensors(tiny_model()), ConfigRecord({}), FixedGrid([4]))
    header = protocol.DownlinkHeader.from_record(downlink_of(msg))
    assert header.error_feedback is False
    assert header.min_compress_numel == 500
    assert header.device == "cpu"
    assert header.bandwidth == strategy.config.bandwidth_budget().to_json()
    assert header.uplink_method == "sbc"
    assert header.uplink_codec == strategy.uplink.round_codec_config(1)
    assert (header.arrays_key, header.config_key) == ("arrays", "config")
    assert ARRAYS not in msg.content.array_records  # the model travels only compressed


def test_record_names_follow_the_inner_strategy() -> None:
    inner = FedAvg(min_train_nodes=1, min_available_nodes=1, arrayrecord_key="weights", configrecord_key="cfg")
    strategy = CompressionStrategy(inner, CompressionConfig())
    w = tiny_model()
    (msg,) = strategy.configure_train(1, record_from_tensors(w), ConfigRecord({}), FixedGrid([1]))
    header = protocol.DownlinkHeader.from_record(downlink_of(msg))
    assert (header.arrays_key, header.config_key) == ("weights", "cfg")
    assert "weights" not in msg.content.array_records
    assert msg.content.config_records["cfg"][protocol.LOCAL_ITERS] == 10
    ctx = context(1)
    seen: dict[str, Any] = {}

    def app(m: Message, c: Any) -> Message:
        got = tensors_from_record(m.content.array_records["weights"])
        seen["model"] = got
        trained = {k: v + 0.01 for k, v in got.items()}
        return Message(
            RecordDict({"weights": record_from_tensors(trained), METRICS: MetricRecord({"num-examples": 5})}),
            reply_to=m,
        )

    from fedcomp.flower.mod import compression_mod

    reply = compression_mod(msg, ctx, app)
    assert not reply.has_error()
    assert all(torch.equal(seen["model"][k], w[k]) for k in w)
    arrays, metrics = strategy.aggregate_train(1, [reply])
    assert arrays is not None and metrics is not None
    assert strategy.traffic[1].rejected == {} and strategy.traffic[1].accepted == 1
    assert set(arrays.keys()) == set(w)


class _Bare(Strategy):
    """An inner strategy without FedAvg's record-name attributes (it delegates to one)."""

    def __init__(self) -> None:
        self._inner = FedAvg(min_train_nodes=1, min_available_nodes=1)

    def configure_train(self, *a: Any) -> Any:
        return self._inner.configure_train(*a)

    def aggregate_train(self, *a: Any) -> Any:
        return self._inner.aggregate_train(*a)

    def configure_evaluate(self, *a: Any) -> Any:
        return self._inner.configure_evaluate(*a)

    def aggregate_evaluate(self, *a: Any) -> Any:
        return self._inner.aggregate_evaluate(*a)

    def summary(self) -> None:
        self._inner.summary()


def test_record_names_default_to_flowers() -> None:
    assert not hasattr(_Bare(), "arrayrecord_key") and not hasattr(_Bare(), "configrecord_key")
    strategy = CompressionStrategy(_Bare(), CompressionConfig())
    (msg,) = strategy.configure_train(1, record_from_tensors(tiny_model()), ConfigRecord({}), FixedGrid([1]))
    header = protocol.DownlinkHeader.from_record(downlink_of(msg))
    assert (header.arrays_key, header.config_key) == ("arrays", "config")


def test_evaluate_with_no_messages_touches_nothing() -> None:
    inner = FedAvg(fraction_evaluate=0.0, min_evaluate_nodes=0, min_available_nodes=1, min_train_nodes=1)
    strategy = CompressionStrategy(inner, CompressionConfig())
    out = strategy.configure_evaluate(1, record_from_tensors(tiny_model()), ConfigRecord({}), FixedGrid([1]))
    assert list(out) == []
    assert strategy.replica is None and strategy.traffic == {}


# --- when the replica advances -------------------------------------------------------------------------


def test_the_replica_advances_once_per_model_change() -> None:
    strategy, clients = make_strategy(), _clients()
    w = tiny_model()
    train_round(strategy, clients, 1, w)
    assert strategy.replica is not None and strategy.replica.version == 0
    assert strategy.traffic[1].encode_seconds == 0.0  # the first model is sent full, not compressed
    # The same model again (evaluate, or a round the inner strategy did not change it): no delta.
    evaluate_round(strategy, clients, 1, w)
    train_round(strategy, clients, 2, w)
    assert strategy.replica.version == 0 and strategy.traffic[2].encode_seconds == 0.0
    # Only one tensor (the small bias) changes: that is a model change.
    w2 = {k: (v + 0.5 if k == "b" else v) for k, v in w.items()}
    train_round(strategy, clients, 3, w2)
    assert strategy.replica.version == 1
    assert strategy.traffic[3].encode_seconds > 0.0
    assert torch.equal(strategy.replica.tensors["b"], w2["b"])  # small tensors go dense: exact


# --- decoding failures and the finish hook -----------------------------------------------------------


def test_an_unexpected_decoder_error_rejects_only_that_reply(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    strategy, clients = make_strategy(), _clients()
    w = tiny_model()
    real = strategy.uplink.decode

    def decode(update, specs, model, server_round, node):  # type: ignore[no-untyped-def]
        if node == 2:
            raise RuntimeError("boom")
        return real(update, specs, model, server_round, node)

    monkeypatch.setattr(strategy.uplink, "decode", decode)
    with caplog.at_level(logging.INFO, logger="flwr.fedcomp"):
        w1, _ = train_round(strategy, clients, 1, w)
    t = strategy.traffic[1]
    assert t.rejected == {2: "payload: decoder failed: RuntimeError: boom"}
    assert t.accepted == 1
    assert w1 is not None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == ["fedcomp: unexpected error decoding node 2's update"]
    assert errors[0].exc_info is not None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "fedcomp: rejected the update of node 2 in round 1: payload: decoder failed: RuntimeError: boom"
    ]


def test_a_payload_error_is_logged_as_a_warning_only(caplog: pytest.LogCaptureFixture) -> None:
    strategy, clients = make_strategy(), _clients()

    def tamper(node: int, reply: Message) -> Message:
        if node == 1:
            rec = dict(reply.content.config_records[protocol.UPLINK])
            rec["payload"] = b"garbage"
            reply.content[protocol.UPLINK] = ConfigRecord(rec)
        return reply

    with caplog.at_level(logging.INFO, logger="flwr.fedcomp"):
        train_round(strategy, clients, 1, tiny_model(), tamper=tamper)
    assert set(strategy.traffic[1].rejected) == {1}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("fedcomp: rejected the update of node 1 in round 1: payload: ")


def test_error_replies_go_to_the_inner_strategy_and_are_not_counted() -> None:
    strategy, clients = make_strategy(), _clients()
    seen: list[int] = []
    inner_aggregate = strategy.strategy.aggregate_train

    def spy(server_round: int, replies):  # type: ignore[no-untyped-def]
        replies = list(replies)
        seen.extend(1 if r.has_error() else 0 for r in replies)
        return inner_aggregate(server_round, replies)

    strategy.strategy.aggregate_train = spy  # type: ignore[method-assign]

    def fail(node: int, reply: Message) -> Message:
        if node == 1:
            from flwr.app import Error

            return Message(Error(code=0, reason="client crashed"), reply_to=reply)
        return reply

    train_round(strategy, clients, 1, tiny_model(), tamper=fail)
    assert sorted(seen) == [0, 1]
    assert strategy.traffic[1].accepted == 1 and strategy.traffic[1].rejected == {}


class _Finisher(SBCUplink):
    """A method whose ``finish`` replaces the aggregate (as GradiVeQ does)."""

    result: dict[str, torch.Tensor] | None = None
    calls: ClassVar[list[tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]]] = []

    def finish(self, server_round, aggregated, model):  # type: ignore[no-untyped-def]
        self.calls.append((server_round, dict(aggregated), dict(model)))
        return self.result


@pytest.mark.parametrize("replace", [True, False], ids=["replaces", "keeps"])
def test_the_finish_hook_sees_the_aggregate_and_may_replace_it(replace: bool) -> None:
    strategy, clients = make_strategy(), _clients()
    method = _Finisher(strategy.config)
    method.calls = []
    fixed = {k: torch.full_like(v, 3.0) for k, v in tiny_model().items()}
    method.result = fixed if replace else None
    strategy.uplink = method
    w = tiny_model()
    w1, _ = train_round(strategy, clients, 1, w)
    assert w1 is not None and len(method.calls) == 1
    rnd, aggregated, model = method.calls[0]
    assert rnd == 1
    assert all(torch.equal(model[k], w[k]) for k in w)  # the global model W the round started from
    assert not torch.equal(aggregated["w1"], w["w1"])  # the inner strategy's aggregate
    if replace:
        assert all(torch.equal(w1[k], fixed[k]) for k in w)
    else:
        assert all(torch.equal(w1[k], aggregated[k]) for k in w)
    assert strategy.traffic[1].decode_seconds > 0


def test_the_base_finish_is_not_called(monkeypatch: pytest.MonkeyPatch) -> None:
    # Methods without their own finish skip it (no tensor conversion of the aggregate).
    from fedcomp.methods.base import UplinkMethod

    def boom(*a: Any) -> None:
        raise AssertionError("UplinkMethod.finish called")

    strategy, clients = make_strategy(), _clients()
    monkeypatch.setattr(UplinkMethod, "finish", boom)
    w1, _ = train_round(strategy, clients, 1, tiny_model())
    assert w1 is not None


# --- small public pieces -----------------------------------------------------------------------------


def test_which_inner_strategies_aggregate_by_weighted_mean() -> None:
    assert aggregates_by_weighted_mean(FedAvg())
    assert aggregates_by_weighted_mean(FedProx(proximal_mu=0.1))
    assert not aggregates_by_weighted_mean(FedAdam())
    assert not aggregates_by_weighted_mean(FedMedian())
    assert make_strategy().uplink.weighted_mean is True
    assert CompressionStrategy(FedMedian(), CompressionConfig()).uplink.weighted_mean is False


def test_summary_logs_the_settings_and_the_inner_summary(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []

    class Inner(FedAvg):
        def summary(self) -> None:
            calls.append("inner")

    config = CompressionConfig.from_run_config({"uplink-codec": "topk"})
    strategy = CompressionStrategy(Inner(), config)
    with caplog.at_level(logging.INFO, logger="flwr.fedcomp"):
        strategy.summary()
    assert calls == ["inner"]
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("fedcomp:")] == [
        f"fedcomp: compressing both ways: {config.describe()}"
    ]
    assert [r.levelno for r in caplog.records if r.getMessage().startswith("fedcomp:")] == [logging.INFO]


def test_repr_names_the_inner_strategy() -> None:
    inner = FedAvg()
    assert repr(CompressionStrategy(inner)) == f"CompressionStrategy({inner!r})"


def test_default_config_and_no_state_before_the_first_round() -> None:
    strategy = CompressionStrategy(FedAvg())
    assert strategy.config == CompressionConfig()
    assert strategy.replica is None and strategy.traffic == {}


def test_round_metrics_are_the_methods() -> None:
    class Counting(SBCUplink):
        def round_metrics(self, server_round: int) -> dict[str, Any]:
            return {"round": server_round}

    strategy = make_strategy()
    strategy.uplink = Counting(strategy.config)
    assert strategy.round_metrics(4) == {"round": 4}
    assert make_strategy().round_metrics(1) == {}


def test_an_arrays_record_is_what_the_wrapper_returns() -> None:
    strategy, clients = make_strategy(), _clients()
    arrays, _ = _aggregate(strategy, 1, tiny_model(), clients)
    assert isinstance(arrays, ArrayRecord)


def _dist(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)) ** 0.5


def test_replica_lag_and_downlink_delivered_are_measured_when_the_replica_advances() -> None:
    strategy, clients = make_strategy(), _clients()
    w0 = tiny_model()
    w1, _ = train_round(strategy, clients, 1, w0)
    assert w1 is not None
    t1 = strategy.traffic[1]
    assert t1.replica_lag is None and t1.downlink_delivered is None  # round 1: the full model
    assert strategy.replica is not None
    r_before = {k: v.clone() for k, v in strategy.replica.tensors.items()}
    w2, _ = train_round(strategy, clients, 2, w1)
    assert w2 is not None
    t2 = strategy.traffic[2]
    after = _dist(w1, strategy.replica.tensors)
    assert t2.replica_lag == pytest.approx(after / _dist(w1, w0), rel=1e-9)
    assert t2.downlink_delivered == pytest.approx(1.0 - after / _dist(w1, r_before), rel=1e-9)
    assert 0.0 < t2.downlink_delivered < 1.0  # 3LC is lossy but delivers most of it
    # Round 3: the lag is relative to how far W moved in round 3, R trails by round 2's leftover too.
    r_before = {k: v.clone() for k, v in strategy.replica.tensors.items()}
    train_round(strategy, clients, 3, w2)
    t3 = strategy.traffic[3]
    after = _dist(w2, strategy.replica.tensors)
    assert t3.replica_lag == pytest.approx(after / _dist(w2, w1), rel=1e-9)
    assert t3.downlink_delivered == pytest.approx(1.0 - after / _dist(w2, r_before), rel=1e-9)


@pytest.mark.parametrize(
    ("drop", "reason"),
    [
        ("record", f"payload: reply has no {protocol.UPLINK} record"),
        ("payload", f"payload: reply has no {protocol.UPLINK} payload"),
    ],
)
def test_a_reply_without_its_update_is_rejected_with_the_exact_reason(drop: str, reason: str) -> None:
    strategy, clients = make_strategy(), _clients()

    def tamper(node: int, reply: Message) -> Message:
        if node == 2:
            if drop == "record":
                reply.content = RecordDict({k: v for k, v in reply.content.items() if k != protocol.UPLINK})
            else:
                rec = {k: v for k, v in reply.content.config_records[protocol.UPLINK].items() if k != "payload"}
                reply.content[protocol.UPLINK] = ConfigRecord(rec)
        return reply

    train_round(strategy, clients, 1, tiny_model(), tamper=tamper)
    assert strategy.traffic[1].rejected == {2: reason}


def test_per_client_reports_and_timings_are_kept_by_node() -> None:
    import time

    strategy, clients = make_strategy(), _clients()
    w = tiny_model()
    train_round(strategy, clients, 1, w)
    w2 = {k: v + 0.01 for k, v in w.items()}
    t0 = time.perf_counter()
    msgs = list(strategy.configure_train(2, record_from_tensors(w2), ConfigRecord({}), FixedGrid(sorted(clients))))
    configure_wall = time.perf_counter() - t0
    replies = [clients[m.metadata.dst_node_id].handle(m) for m in msgs]
    t0 = time.perf_counter()
    strategy.aggregate_train(2, replies)
    wall = time.perf_counter() - t0
    t = strategy.traffic[2]
    assert set(t.client_encode_seconds) == set(t.train_seconds) == set(t.uplink) == set(NODES)
    assert set(t.residual_ratio) == set(NODES)
    # Server timings are durations measured inside the call, not clock readings.
    assert 0.0 < t.decode_seconds <= wall
    assert 0.0 < t.encode_seconds <= configure_wall
