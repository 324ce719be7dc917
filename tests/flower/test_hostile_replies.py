"""Replies that would have ended a run or skewed the model are rejected one by one, the round goes
on with the others, and a client whose own training diverged keeps its state and its place."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from fedcomp.codecs import SBC, DenseFP32, TopK
from fedcomp.flower import mod as mod_module
from fedcomp.flower import protocol
from fedcomp.flower.records import record_from_tensors
from fedcomp.flower.traffic import metric_record
from fedcomp.methods.update import UpdateEncoder
from fedcomp.wire.serde import update_from_bytes, update_to_bytes
from tests.flower.helpers import (  # noqa: F401  (server_identity: autouse fixture)
    Client,
    FixedGrid,
    decode_payload,
    make_strategy,
    mode_of,
    server_identity,
    tiny_model,
    train_round,
    with_fields,
)


@pytest.fixture
def unclipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients that ignore the server's ``max-update-norm`` (a mod before the field, or a hostile
    client): what the server's own check is for. The mod keeps honest clients within it."""
    monkeypatch.setattr(mod_module, "_max_update_norm", lambda dl: None)


def _replace_content(reply: Message, **records: Any) -> Message:
    content = RecordDict(dict(reply.content.items()))
    for k, v in records.items():
        if v is None:
            del content[k]
        else:
            content[k] = v
    reply.content = content
    return reply


def _with_update(reply: Message, tensors_of: Any, codec: Any = None) -> Message:
    """``reply`` with its update replaced by ``tensors_of(parsed update)``, encoded by ``codec``
    (dense fp32 by default)."""
    up = reply.content.config_records[protocol.UPLINK]
    update = update_from_bytes(up["payload"])  # type: ignore[arg-type]
    enc = UpdateEncoder(codec or DenseFP32(), min_numel=0, error_feedback=False).encode(
        tensors_of(update), update.base_model_version
    )
    return _replace_content(reply, **{protocol.UPLINK: with_fields(up, payload=update_to_bytes(enc))})


def _nan_payload(reply: Message) -> Message:
    def tensors_of(update: Any) -> dict[str, torch.Tensor]:
        tensors = {t.name: torch.zeros(t.shape) for t in update.tensors}
        next(iter(tensors.values()))[0] = float("nan")
        return tensors

    return _with_update(reply, tensors_of)


def _huge_payload(reply: Message, magnitude: float = 1e30, codec: Any = None) -> Message:
    """``reply`` with an update of random values in ``[magnitude / 2, magnitude)``."""
    gen = torch.Generator().manual_seed(7)
    return _with_update(
        reply,
        lambda update: {t.name: (1 + torch.rand(t.shape, generator=gen)) * (magnitude / 2) for t in update.tensors},
        codec,
    )


def _metrics(value: Any) -> Any:
    def tamper(reply: Message) -> Message:
        return _replace_content(reply, metrics=None if value is None else MetricRecord({"num-examples": value}))

    return tamper


TAMPERS = {
    "nan-in-a-dense-tensor": (_nan_payload, "not all finite"),
    "extra-array-record": (lambda r: _replace_content(r, extra=ArrayRecord({"x": torch.zeros(3)})), "ArrayRecord"),
    "no-metric-record": (_metrics(None), "MetricRecords"),
    "negative-examples": (_metrics(-10), "outside"),
    "huge-examples": (_metrics(10**15), "outside"),
    "examples-not-a-number": (_metrics([1, 2]), "not a number"),
}


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_a_hostile_reply_is_rejected_and_the_round_goes_on(case: str) -> None:
    tamper, why = TAMPERS[case]
    strategy = make_strategy(**{"uplink-codec": "dense-fp32"})
    clients = {n: Client(n) for n in (1, 2, 3)}
    model = tiny_model()
    new, _ = train_round(strategy, clients, 1, model, tamper=lambda n, r: tamper(r) if n == 2 else r)
    t = strategy.traffic[1]
    assert list(t.rejected) == [2] and why in t.rejected[2], t.rejected
    assert t.accepted == 2 and new is not None
    assert sorted(t.update_norm) == [1, 3]  # (client_update_norm: accepted updates only)
    assert all(bool(torch.isfinite(v).all()) for v in new.values())
    # The rejected client's replica state is intact: a chain next round, not a full model.
    _, log = train_round(strategy, clients, 2, new)
    assert mode_of(log.downlinks[2]) == "chain"


@pytest.mark.usefixtures("unclipped")
def test_an_update_over_the_norm_bound_is_rejected() -> None:
    strategy = make_strategy(**{"max-update-norm": 1e-6})
    clients = {n: Client(n) for n in (1, 2)}
    _, _ = train_round(strategy, clients, 1, tiny_model())
    assert set(strategy.traffic[1].rejected) == {1, 2}
    assert all("max-update-norm" in why for why in strategy.traffic[1].rejected.values())


@pytest.mark.parametrize("uplink", ["sbc", "dense-fp32", "gradiveq"])
def test_honest_clients_keep_within_max_update_norm_and_are_never_rejected(
    uplink: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An own-app audit set max-update-norm a little over honest norms: each rejected update went
    back into the residual, the next was larger, and by round 4 every client was rejected. The
    downlink now carries the bound; the mod sends at most that (the rest stays in its residual, or
    is dropped without error feedback, GradiVeQ), so every honest update is aggregated. A client
    that ignores the bound is still rejected, round after round."""
    probe = make_strategy(**{"uplink-codec": uplink})
    train_round(probe, {n: Client(n) for n in (1, 2)}, 1, tiny_model())
    bound = 0.5 * min(probe.traffic[1].update_norm.values())  # below every honest update
    for clips in (True, False):
        if not clips:
            monkeypatch.setattr(mod_module, "_max_update_norm", lambda dl: None)
        strategy = make_strategy(**{"uplink-codec": uplink, "max-update-norm": bound, "max-empty-rounds": 9})
        clients, model = {n: Client(n) for n in (1, 2)}, tiny_model()
        for rnd in range(1, 5):
            new, log = train_round(strategy, clients, rnd, model)
            t = strategy.traffic[rnd]
            if clips:
                assert protocol.DownlinkHeader.from_record(log.downlinks[1]).max_update_norm == bound
                assert t.accepted == 2 and not t.rejected, (rnd, t.rejected)
                assert all(bound * 0.99 < v <= bound for v in t.update_norm.values()), t.update_norm
            else:
                assert t.accepted == 0 and all("exceeds max-update-norm" in w for w in t.rejected.values())
            model = new if new is not None else model


@pytest.mark.usefixtures("unclipped")
@pytest.mark.parametrize("inner", ["fedavg", "fedavgm"])
def test_max_update_norm_bounds_gradiveqs_update_not_the_model_or_its_coefficients(inner: str) -> None:
    """GradiVeQ's compressed rounds: with FedAvg the server aggregates coefficients, with FedAvgM
    it decodes each reply to ``W + delta``; either way the bound is on the update in model space
    (here about 0.57, the model about 5.7): 1.0 lets every reply through, 0.3 none."""
    from flwr.serverapp.strategy import FedAvg, FedAvgM

    from fedcomp.flower.settings import CompressionConfig
    from fedcomp.flower.strategy import CompressionStrategy

    for bound, accepted in ((1.0, 2), (0.3, 0)):
        every = {"fraction_train": 1.0, "fraction_evaluate": 1.0, "min_train_nodes": 1, "min_available_nodes": 1}
        strategy = CompressionStrategy(
            FedAvg(**every) if inner == "fedavg" else FedAvgM(**every),
            CompressionConfig.from_run_config(
                {
                    "uplink-codec": "gradiveq",
                    "gradiveq-dense-rounds": 2,
                    "max-update-norm": bound,
                    "max-empty-rounds": 9,
                }
            ),
        )
        clients, model = {n: Client(n) for n in (1, 2)}, tiny_model()
        for rnd in range(1, 5):  # rounds 3 and 4 are compressed
            new, _ = train_round(strategy, clients, rnd, model)
            assert strategy.traffic[rnd].accepted == accepted, (bound, rnd, strategy.traffic[rnd].rejected)
            model = new if new is not None else model


class DivergingClient(Client):
    """Training that produces NaN in round 2."""

    def app(self, msg: Message, ctx: Any) -> Message:
        reply = super().app(msg, ctx)
        cfg = msg.content.config_records["config"]
        if int(cfg[protocol.SERVER_ROUND]) == 2:  # type: ignore[arg-type]
            arrays = reply.content.array_records["arrays"].to_torch_state_dict()
            first = next(iter(arrays))
            arrays[first].view(-1)[0] = float("nan")
            reply.content["arrays"] = ArrayRecord(arrays)
        return reply


def test_a_diverged_client_sends_an_error_keeps_its_state_and_comes_back() -> None:
    strategy = make_strategy()
    clients: dict[int, Client] = {1: Client(1), 2: DivergingClient(2)}
    model = tiny_model()
    new, _ = train_round(strategy, clients, 1, model)
    assert new is not None
    residual = clients[2].ctx.state.array_records[protocol.STATE_RESIDUAL].to_torch_state_dict()
    new2, log = train_round(strategy, clients, 2, new)
    reply = log.replies[2]
    assert reply.has_error() and reply.error.code == int(protocol.ErrorCode.LOCAL_UPDATE_REJECTED)
    assert "not finite" in reply.error.reason
    assert strategy.traffic[2].accepted == 1 and new2 is not None
    # counted and logged as a failed reply, with the client's reason (not rejected, not missing)
    t = strategy.traffic[2]
    assert list(t.failed) == [2] and "not finite" in t.failed[2] and not t.rejected and not t.unanswered
    assert metric_record(t, strategy.traffic)["fedcomp.replies-failed"] == 1
    # Residual untouched by the failed round; the server still knows its replica: a chain next.
    after = clients[2].ctx.state.array_records[protocol.STATE_RESIDUAL].to_torch_state_dict()
    assert all(torch.equal(residual[k], after[k]) for k in residual)
    _, log = train_round(strategy, clients, 3, new2)
    assert mode_of(log.downlinks[2]) == "chain" and not log.replies[2].has_error()
    assert strategy.traffic[3].accepted == 2


class FailingOnceClient(Client):
    """Its app fails in round 2, after the mod applied that round's downlink."""

    def app(self, msg: Message, ctx: Any) -> Message:
        if int(msg.content.config_records["config"][protocol.SERVER_ROUND]) == 2:  # type: ignore[arg-type]
            return Message(Error(code=42, reason="out of memory"), reply_to=msg)
        return super().app(msg, ctx)


def test_after_an_app_error_the_next_chain_skips_the_deltas_the_client_already_holds() -> None:
    strategy = make_strategy()
    clients: dict[int, Client] = {1: Client(1), 2: FailingOnceClient(2)}
    model = tiny_model()
    for rnd in (1, 2, 3):
        new, log = train_round(strategy, clients, rnd, model)
        assert new is not None
        model = new
    # Round 3: the server still counted node 2 at the version before round 2's delta, which the
    # client had applied and kept; it skips that delta, applies the rest and trains: no resync.
    assert mode_of(log.downlinks[2]) == "chain" and not log.replies[2].has_error()
    assert strategy.traffic[3].accepted == 2 and not strategy.traffic[3].rejected


UPLINK_MUTATIONS = {
    "replica-version-text": {"replica_version": "7"},
    "replica-version-float": {"replica_version": 7.5},
    "train-seconds-nan": {"train_seconds": float("nan")},
    "update-round-text": {"update_round": "1"},
    "update-round-other": {"update_round": 99},
    "status-float": {"gradiveq.version": 1.5},
}


@pytest.mark.parametrize("method", ["sbc", "gradiveq"])
@pytest.mark.parametrize("case", sorted(UPLINK_MUTATIONS))
def test_a_malformed_uplink_record_never_ends_a_round_train_or_evaluate(method: str, case: str) -> None:
    """Issue #14 item 2: a malformed uplink record raised outside the per-reply guard (in the
    replica bookkeeping, also of aggregate_evaluate and GradiVeQ's node bookkeeping)."""
    change = UPLINK_MUTATIONS[case]

    def tamper(node: int, reply: Message) -> Message:
        if node != 2 or not reply.has_content():
            return reply
        up = reply.content.config_records[protocol.UPLINK]
        return _replace_content(reply, **{protocol.UPLINK: with_fields(up, **change)})

    strategy = make_strategy(**{"uplink-codec": method})
    clients = {n: Client(n) for n in (1, 2, 3)}
    model = tiny_model()
    new, _ = train_round(strategy, clients, 1, model, tamper=tamper)
    assert new is not None and strategy.traffic[1].accepted == 2 and list(strategy.traffic[1].rejected) == [2]
    # The evaluate round: the same mutation in node 2's evaluate reply.
    grid_msgs = list(strategy.configure_evaluate(1, record_from_tensors(new), ConfigRecord({}), FixedGrid([1, 2, 3])))
    replies = [tamper(m.metadata.dst_node_id, clients[m.metadata.dst_node_id].handle(m)) for m in grid_msgs]
    assert strategy.aggregate_evaluate(1, replies) is not None
    # The round after: node 2 is served (a full replica if the server forgot its state) and counts.
    _, log = train_round(strategy, clients, 2, new)
    assert not log.replies[2].has_error() and strategy.traffic[2].accepted == 3


class OverflowingClient(Client):
    """Its round-2 update holds a value beyond float16's range (65504)."""

    def app(self, msg: Message, ctx: Any) -> Message:
        reply = super().app(msg, ctx)
        if int(msg.content.config_records["config"][protocol.SERVER_ROUND]) == 2:  # type: ignore[arg-type]
            arrays = reply.content.array_records["arrays"].to_torch_state_dict()
            arrays["w1"].view(-1)[0] += 1e6
            reply.content["arrays"] = ArrayRecord(arrays)
        return reply


def test_an_update_the_codec_cannot_represent_is_not_sent_and_poisons_nothing() -> None:
    strategy = make_strategy(**{"uplink-codec": "dense-fp16"})
    clients: dict[int, Client] = {1: Client(1), 2: OverflowingClient(2)}
    new, _ = train_round(strategy, clients, 1, tiny_model())
    assert new is not None
    state = clients[2].ctx.state
    before = {k: dict(state.array_records[k].to_torch_state_dict()) for k in state.array_records}
    new2, log = train_round(strategy, clients, 2, new)
    reply = log.replies[2]
    assert reply.has_error() and reply.error.code == int(protocol.ErrorCode.LOCAL_UPDATE_REJECTED)
    assert "encoded update is not finite" in reply.error.reason and "w1" in reply.error.reason
    after = {k: dict(state.array_records[k].to_torch_state_dict()) for k in state.array_records}
    assert after.keys() == before.keys()
    assert all(torch.equal(after[r][k], before[r][k]) for r in before for k in before[r])
    assert new2 is not None
    _, log = train_round(strategy, clients, 3, new2)
    assert not log.replies[2].has_error() and strategy.traffic[3].accepted == 2


def _metrics_of(reply: Message) -> tuple[str, MetricRecord]:
    return next(iter(reply.content.metric_records.items()))


def _renamed(reply: Message) -> Message:
    name, rec = _metrics_of(reply)
    return _replace_content(reply, **{name: None, "other-metrics": rec})


def _extra_key(reply: Message) -> Message:
    name, rec = _metrics_of(reply)
    return _replace_content(reply, **{name: MetricRecord({**dict(rec), "extra": 1.0})})


def _list_metric(length: int) -> Any:
    def tamper(reply: Message) -> Message:
        name, rec = _metrics_of(reply)
        return _replace_content(reply, **{name: MetricRecord({**dict(rec), "curve": [0.5] * length})})

    return tamper


SHAPE_TAMPERS = {
    "renamed-metric-record": _renamed,
    "extra-metric-key": _extra_key,
    "list-metric": _list_metric(3),
}


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("case", sorted(SHAPE_TAMPERS))
def test_a_train_reply_whose_metrics_differ_from_the_others_keeps_its_update(
    case: str, streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Flower's strategies require every reply's MetricRecord to have one name and one key set
    (InconsistentMessageReplies otherwise). The odd reply out was rejected, update and all; now
    every update is aggregated, the metrics over the keys all replies share, with a warning."""
    from flwr.serverapp.strategy import FedAvg, FedMedian

    from fedcomp.flower.settings import CompressionConfig
    from fedcomp.flower.strategy import CompressionStrategy

    every = {"fraction_train": 1.0, "fraction_evaluate": 1.0, "min_train_nodes": 1, "min_available_nodes": 1}
    strategy = CompressionStrategy((FedAvg if streaming else FedMedian)(**every), CompressionConfig())
    assert strategy.streaming == streaming
    clients = {n: Client(n) for n in (1, 2, 3)}
    new, _ = train_round(
        strategy, clients, 1, tiny_model(), tamper=lambda n, r: SHAPE_TAMPERS[case](r) if n == 3 else r
    )
    t = strategy.traffic[1]
    assert new is not None and t.accepted == 3 and not t.rejected, t.rejected
    assert strategy.outcome_state()["last-update"]["3"][:2] == [1, "aggregated"]
    assert "round 1 (train): the replies' MetricRecords differ" in caplog.text


def _honest_metrics(strategy: Any, clients: dict[int, Client], tamper: Any) -> tuple[Any, Any]:
    """The aggregated train metrics of one round, tampered by ``tamper(node, reply)``."""
    out = strategy.strategy.train_metrics_aggr_fn
    seen: list[Any] = []

    def spy(contents: Any, key: str) -> Any:
        seen.append(out(contents, key))
        return seen[-1]

    strategy.strategy.train_metrics_aggr_fn = spy
    new, _ = train_round(strategy, clients, 1, tiny_model(), tamper=tamper)
    return new, seen[0]


def test_what_a_reply_keeps_does_not_depend_on_who_is_seen_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender picks its payload's bytes, so the order the replies are read in (by the payload's
    hash) is its to choose. With two replies of different shapes the first used to win the tie
    and the other was rejected: whatever the order now, both are aggregated, over the shared keys."""
    import fedcomp.flower.strategy as strategy_module

    order = strategy_module._reply_order
    results = []
    for first in (1, 2):
        strategy = make_strategy()
        clients = {n: Client(n) for n in (1, 2)}
        with monkeypatch.context() as m:
            m.setattr(strategy_module, "_reply_order", lambda msg, f=first: (msg.metadata.src_node_id != f, order(msg)))
            new, metrics = _honest_metrics(strategy, clients, lambda n, r: _extra_key(r) if n == 2 else r)
        assert new is not None and strategy.traffic[1].accepted == 2 and not strategy.traffic[1].rejected
        results.append((sorted(metrics), {k: v.tolist() for k, v in new.items()}))
    assert results[0] == results[1]
    assert "extra" not in results[0][0]


EVALUATE_TAMPERS = {
    "num-examples-missing": (_metrics(None), "MetricRecords, expected 1"),
    "num-examples-nan": (_metrics(float("nan")), "not a number"),
    "extra-metric-record": (lambda r: _replace_content(r, more=MetricRecord({"x": 1.0})), "2 MetricRecords"),
}


def _evaluate_round() -> tuple[Any, dict[int, Message]]:
    """A strategy after one train round of nodes 1-3, and their honest evaluate replies."""
    strategy = make_strategy()
    clients = {n: Client(n) for n in (1, 2, 3)}
    new, _ = train_round(strategy, clients, 1, tiny_model())
    assert new is not None
    msgs = list(strategy.configure_evaluate(1, record_from_tensors(new), ConfigRecord({}), FixedGrid([1, 2, 3])))
    return strategy, {m.metadata.dst_node_id: clients[m.metadata.dst_node_id].handle(m) for m in msgs}


@pytest.mark.parametrize("case", sorted(EVALUATE_TAMPERS))
def test_a_malformed_evaluate_reply_is_left_out_and_the_round_goes_on(case: str) -> None:
    tamper, why = EVALUATE_TAMPERS[case]
    strategy, honest = _evaluate_round()
    replies = [tamper(r) if n == 2 else r for n, r in honest.items()]
    metrics = strategy.aggregate_evaluate(1, replies)
    assert metrics is not None and "loss" in metrics
    assert list(strategy.traffic[1].rejected_evaluate) == [2] and why in strategy.traffic[1].rejected_evaluate[2]


@pytest.mark.parametrize("case", ["renamed-metric-record", "list-metric-length"])
def test_evaluate_replies_whose_metrics_differ_are_all_aggregated(case: str) -> None:
    strategy, honest = _evaluate_round()
    if case == "list-metric-length":  # two report lists of length 3, node 2 one of length 2
        honest = {n: _list_metric(3)(r) if n != 2 else _list_metric(2)(r) for n, r in honest.items()}
    else:
        honest[2] = _renamed(honest[2])
    metrics = strategy.aggregate_evaluate(1, list(honest.values()))
    assert metrics is not None and "loss" in metrics and "curve" not in metrics
    assert not strategy.traffic[1].rejected_evaluate


@pytest.mark.parametrize("inner", ["fedavg", "fedmedian"])  # streaming; materialising
def test_a_record_under_the_models_key_is_rejected_and_the_round_goes_on(inner: str) -> None:
    """A reply whose MetricRecord is named like the inner strategy's ArrayRecord key ("arrays"):
    the model overwrote it (materialising) or it overwrote the model (streaming), and the round
    ended with a StopIteration or an 'exactly one ArrayRecord' error (hostile-replies audit)."""
    from flwr.serverapp.strategy import FedAvg, FedMedian

    from fedcomp.flower.settings import CompressionConfig
    from fedcomp.flower.strategy import CompressionStrategy

    every = {"fraction_train": 1.0, "fraction_evaluate": 1.0, "min_train_nodes": 1, "min_available_nodes": 1}

    def tamper(node: int, reply: Message) -> Message:
        if node != 2:
            return reply
        return _replace_content(reply, metrics=None, arrays=MetricRecord({"num-examples": 10}))

    for nodes in ((1, 2, 3), (2,)):  # (alone: nothing to aggregate)
        strategy = CompressionStrategy(
            (FedAvg if inner == "fedavg" else FedMedian)(**every),
            CompressionConfig.from_run_config({"uplink-codec": "dense-fp32"}),
        )
        assert strategy.streaming == (inner == "fedavg")
        new, _ = train_round(strategy, {n: Client(n) for n in nodes}, 1, tiny_model(), tamper=tamper)
        t = strategy.traffic[1]
        assert list(t.rejected) == [2] and "the key the model goes under" in t.rejected[2], t.rejected
        assert (new is not None) == (len(nodes) == 3)


@pytest.mark.parametrize("poison", ["nan", "over-the-norm-bound"])
def test_gradiveqs_compressor_learns_nothing_from_a_rejected_reply(poison: str) -> None:
    """GradiVeQ fits its compressor on the dense rounds' replies. It took a reply's samples before
    the server's checks, so a rejected NaN (or, without a norm bound, a huge) update made the
    next basis NaN and every honest client fail for a whole refresh cycle."""
    strategy = make_strategy(**{"uplink-codec": "gradiveq", "gradiveq-dense-rounds": 2, "max-update-norm": 100.0})
    clients, model = {n: Client(n) for n in (1, 2, 3)}, tiny_model()

    bad = _nan_payload if poison == "nan" else _huge_payload
    for rnd in range(1, 5):  # rounds 1-2 dense (node 2 hostile), 3-4 compressed
        hostile = bad if rnd <= 2 else (lambda r: r)
        new, log = train_round(strategy, clients, rnd, model, tamper=lambda n, r, f=hostile: f(r) if n == 2 else r)
        t = strategy.traffic[rnd]
        assert list(t.rejected) == ([2] if rnd <= 2 else []), (rnd, t.rejected)
        assert t.accepted == (2 if rnd <= 2 else 3), (
            rnd,
            t.accepted,
            {n: r.has_error() for n, r in log.replies.items()},
        )
        assert new is not None and all(bool(torch.isfinite(v).all()) for v in new.values())
        model = new
    assert strategy.uplink.version == 1  # type: ignore[attr-defined]


def test_a_gradiveq_fit_that_comes_out_unusable_keeps_the_compressor_before(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fit that fails, or whose compressor the clients would refuse (a basis that is not
    finite), is not sent: the run stays on the compressor it had (none yet: dense rounds) and
    says so, where it ended the run before."""
    from fedcomp.methods import gradiveq_uplink

    def overflowed(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("basis or whitening holds NaN or infinite values")

    monkeypatch.setattr(gradiveq_uplink, "fit_compressor", overflowed)
    strategy = make_strategy(**{"uplink-codec": "gradiveq", "gradiveq-dense-rounds": 2})
    clients, model = {n: Client(n) for n in (1, 2, 3)}, tiny_model()
    for rnd in (1, 2, 3):
        new, _ = train_round(strategy, clients, rnd, model)
        assert strategy.traffic[rnd].accepted == 3 and new is not None
        model = new
    assert strategy.uplink.version == 0 and strategy.uplink.compressor is None  # type: ignore[attr-defined]
    assert "GradiVeQ: no new compressor from this cycle's samples (basis or whitening" in caplog.text
    assert strategy.uplink.round_codec_config(3) == {"id": "dense-fp32"}


@pytest.mark.parametrize("inner", ["fedavg", "fedmedian"])  # streaming; materialising
def test_an_aggregate_that_overflows_leaves_the_model_as_it_was(inner: str, caplog: pytest.LogCaptureFixture) -> None:
    """Finite replies whose ``W + delta`` overflows float32 (one client's update near float32's
    largest value, twice, without max-update-norm): the aggregate held infinities, and the next
    round's downlink encoder ended the run. Now the round aggregates nothing (Flower keeps the
    model), its clients hear why, and the next round goes on from the finite model."""
    from flwr.serverapp.strategy import FedAvg, FedMedian

    from fedcomp.flower.settings import CompressionConfig
    from fedcomp.flower.strategy import CompressionStrategy

    every = {"fraction_train": 1.0, "fraction_evaluate": 1.0, "min_train_nodes": 1, "min_available_nodes": 1}
    strategy = CompressionStrategy(
        (FedAvg if inner == "fedavg" else FedMedian)(**every),
        CompressionConfig.from_run_config({"uplink-codec": "dense-fp32", "downlink-codec": "dense-fp32"}),
    )
    # (FedMedian's median of three is the attacker's when two send it: nodes 2 and 3 attack)
    attackers = (2,) if inner == "fedavg" else (2, 3)

    def tamper(node: int, reply: Message) -> Message:
        if node not in attackers:
            return reply
        reply = _huge_payload(reply, 3e38)
        return _replace_content(reply, metrics=MetricRecord({"num-examples": 10**9}))

    clients, model = {n: Client(n) for n in (1, 2, 3)}, tiny_model()
    new, _ = train_round(strategy, clients, 1, model, tamper=tamper)
    assert new is not None and all(bool(torch.isfinite(v).all()) for v in new.values())  # huge, finite
    again, _ = train_round(strategy, clients, 2, new, tamper=tamper)
    assert again is None, "an aggregate that is not finite must not become the model"
    assert "not finite" in strategy.traffic[2].aggregate_refused  # (the app counts the round as empty)
    assert "round 2: the round's aggregate is not finite" in caplog.text
    status = strategy._last_update[1]
    assert status[0] == 2 and status[1] == protocol.UpdateStatus.REJECTED and "not finite" in status[2]
    after, _ = train_round(strategy, clients, 3, new)  # Flower hands the model it kept back
    assert after is not None and all(bool(torch.isfinite(v).all()) for v in after.values())


@pytest.mark.usefixtures("unclipped")
@pytest.mark.parametrize("inner", ["fedavg", "fedmedian"])  # streaming; materialising
@pytest.mark.parametrize("uplink", ["sbc", "dense-fp32", "deft"])
def test_the_recorded_update_norms_are_what_max_update_norm_bounds(uplink: str, inner: str) -> None:
    """Each accepted update's norm is recorded (results.json's ``client_update_norm``) so that a
    user can set ``max-update-norm`` from honest clients' figures: a bound just under the largest
    rejects that client's update alone, in the same run again."""
    from flwr.serverapp.strategy import FedAvg, FedMedian

    from fedcomp.flower.settings import CompressionConfig
    from fedcomp.flower.strategy import CompressionStrategy

    def strategy_with(**run_config: Any) -> CompressionStrategy:
        every = {"fraction_train": 1.0, "fraction_evaluate": 1.0, "min_train_nodes": 1, "min_available_nodes": 1}
        return CompressionStrategy(
            (FedAvg if inner == "fedavg" else FedMedian)(**every),
            CompressionConfig.from_run_config({"uplink-codec": uplink, **run_config}),
        )

    strategy = strategy_with()
    train_round(strategy, {n: Client(n) for n in (1, 2, 3)}, 1, tiny_model())
    norms = strategy.traffic[1].update_norm
    assert sorted(norms) == [1, 2, 3] and all(0 < v < float("inf") for v in norms.values()), norms
    top = max(norms, key=norms.__getitem__)
    again = strategy_with(**{"max-update-norm": norms[top] * (1 - 1e-6)})
    train_round(again, {n: Client(n) for n in (1, 2, 3)}, 1, tiny_model())
    assert list(again.traffic[1].rejected) == [top], again.traffic[1].rejected
    assert again.traffic[1].update_norm == {n: v for n, v in norms.items() if n != top}


#: uplink -> what the hostile client sends: dense values (the streaming kernel's dense task); SBC's
#: positions and one mean (its positions task); top-k's positions and values (a sparse term).
HUGE_SENDERS = {"dense-fp32": None, "sbc": lambda: SBC(p=0.1), "topk": lambda: TopK(p=0.1)}


@pytest.mark.parametrize("inner", ["fedavg", "fedmedian"])  # streaming; materialising
@pytest.mark.parametrize("uplink", sorted(HUGE_SENDERS))
def test_an_update_past_the_lattice_grid_is_rejected_and_the_run_goes_on(uplink: str, inner: str) -> None:
    """The lattice downlink sends ``round(W / h)`` below 2**24 on a grid the run's first rounds
    set. One client's finite update of 1e30 (no max-update-norm) was aggregated, and the next
    round's downlink raised: the run ended. Now that reply is rejected, naming the grid; the
    others are aggregated and the run goes on."""
    from flwr.serverapp.strategy import FedAvg, FedMedian

    from fedcomp.flower.settings import CompressionConfig
    from fedcomp.flower.strategy import CompressionStrategy

    every = {"fraction_train": 1.0, "fraction_evaluate": 1.0, "min_train_nodes": 1, "min_available_nodes": 1}
    strategy = CompressionStrategy(
        (FedAvg if inner == "fedavg" else FedMedian)(**every),
        CompressionConfig.from_run_config({"uplink-codec": uplink, "downlink-codec": "lattice"}),
    )
    clients, model, codec = {n: Client(n) for n in (1, 2, 3)}, tiny_model(), HUGE_SENDERS[uplink]
    for rnd in (1, 2, 3, 4):
        hostile = rnd in (2, 3)  # (round 2: the grid was just set from round 1's movement)
        new, _ = train_round(
            strategy,
            clients,
            rnd,
            model,
            tamper=lambda n, r, h=hostile: _huge_payload(r, codec=codec and codec()) if h and n == 2 else r,
        )
        t = strategy.traffic[rnd]
        if hostile:
            assert list(t.rejected) == [2] and "lattice downlink's grid" in t.rejected[2], t.rejected
        assert t.accepted == (2 if hostile else 3) and new is not None, (rnd, t.rejected)
        assert all(float(v.abs().max()) < 1e3 for v in new.values())
        model = new
    assert strategy._last_update[2][:2] == (4, protocol.UpdateStatus.AGGREGATED)


def test_a_server_step_past_the_lattice_grid_keeps_the_model(caplog: pytest.LogCaptureFixture) -> None:
    """Replies that each stay on the grid average onto it, but the inner strategy's own step may
    leave it (FedAdam with a huge server learning rate here): that round keeps the model, with an
    error line, and the run goes on (the downlink raised, ending the run)."""
    from flwr.serverapp.strategy import FedAdam

    from fedcomp.flower.settings import CompressionConfig
    from fedcomp.flower.strategy import CompressionStrategy

    every = {"fraction_train": 1.0, "fraction_evaluate": 1.0, "min_train_nodes": 1, "min_available_nodes": 1}
    strategy = CompressionStrategy(FedAdam(**every), CompressionConfig.from_run_config({"downlink-codec": "lattice"}))
    clients, model = {n: Client(n) for n in (1, 2)}, tiny_model()
    new, _ = train_round(strategy, clients, 1, model)  # (round 1: no grid yet)
    assert new is not None
    strategy.strategy.eta = 1e9  # type: ignore[attr-defined]  # (round 2's step, past the grid round 1 set)
    again, _ = train_round(strategy, clients, 2, new)
    assert again is None and strategy.traffic[2].accepted == 2 and "grid" in strategy.traffic[2].aggregate_refused
    assert "round 2: the round's aggregate leaves the lattice downlink's grid" in caplog.text
    status = strategy._last_update[1]
    assert status[:2] == (2, protocol.UpdateStatus.REJECTED) and "grid" in status[2]
    after, _ = train_round(strategy, clients, 3, new)  # Flower hands back the model it kept
    assert strategy.traffic[3].accepted == 2


def test_an_honest_outlier_past_the_lattice_grid_is_averaged_back_onto_it() -> None:
    """One client's reply that takes a weight a few times past the grid's bound (a running
    variance on skewed data, say) is not rejected by itself: the replies average back onto the
    grid, and every update is aggregated (it was rejected in every round, its residual growing,
    a review found). A reply over ``REPLY_SLACK`` times past is rejected; an aggregate past the
    bound keeps the model that round."""
    from fedcomp.flower.grid_fit import REPLY_SLACK

    strategy = make_strategy(**{"downlink-codec": "lattice", "uplink-codec": "dense-fp32"})
    clients, model = {n: Client(n) for n in (1, 2, 3)}, tiny_model()
    first, _ = train_round(strategy, clients, 1, model)
    assert first is not None
    new, _ = train_round(strategy, clients, 2, first)  # (round 2's downlink set the grid)
    assert new is not None and strategy.replica is not None and strategy.replica.grid is not None
    e = strategy.replica.grid["w1"]
    bound = (2**24 - 1) * 2.0**e

    def outlier(times: float) -> Any:
        def tamper(node: int, reply: Message) -> Message:
            if node != 2:
                return reply

            def tensors_of(update: Any) -> dict[str, torch.Tensor]:
                out = {t.name: torch.zeros(t.shape) for t in update.tensors}
                out["w1"].view(-1)[0] = times * bound - float(new["w1"].view(-1)[0])  # W + delta there
                return out

            return _with_update(reply, tensors_of)

        return tamper

    got, _ = train_round(strategy, clients, 3, new, tamper=outlier(2.0))
    t = strategy.traffic[3]
    assert t.accepted == 3 and not t.rejected and got is not None  # the mean: about 2/3 of the bound
    assert float(got["w1"].abs().max()) < bound
    again, _ = train_round(strategy, clients, 4, got, tamper=outlier(REPLY_SLACK * 1.5))
    assert list(strategy.traffic[4].rejected) == [2] and "1024 times past" in strategy.traffic[4].rejected[2]
    assert again is not None and strategy.traffic[4].accepted == 2


def _long_name(reply: Message) -> Message:
    def tensors_of(update: Any) -> dict[str, torch.Tensor]:
        tensors = {t.name: torch.zeros(t.shape) for t in update.tensors}
        last = list(tensors)[-1]
        tensors["A" * 2_000_000] = tensors.pop(last)  # a name the parser's size bound lets through
        return tensors

    return _with_update(reply, tensors_of)


def _long_field(reply: Message) -> Message:
    up = reply.content.config_records[protocol.UPLINK]
    return _replace_content(reply, **{protocol.UPLINK: ConfigRecord({**dict(up), "x" * 2_000_000: 1})})


LONG_QUOTES = {
    "tensor-name": _long_name,
    "examples-list": _metrics([0.5] * 300_000),
    "uplink-field": _long_field,
}


@pytest.mark.parametrize("case", sorted(LONG_QUOTES))
def test_a_rejection_reason_quoting_what_a_client_sent_stays_short(case: str, caplog: pytest.LogCaptureFixture) -> None:
    """A reason may quote a client's name, value or field: a hostile client's megabytes were kept
    whole in every round's figures (then results.json, the checkpoint) and the log, growing them by
    megabytes a round (red-team audit: results.json 12 MB a round). Reasons are cut now, and the
    quote is built short."""
    strategy = make_strategy()
    clients = {n: Client(n) for n in (1, 2, 3)}
    with caplog.at_level("WARNING", logger="flwr.fedcomp"):
        new, _ = train_round(
            strategy, clients, 1, tiny_model(), tamper=lambda n, r: LONG_QUOTES[case](r) if n == 2 else r
        )
    t = strategy.traffic[1]
    assert new is not None and t.accepted == 2 and list(t.rejected) == [2]
    assert (
        len(t.rejected[2]) <= protocol.MAX_REASON_CHARS
        and len(strategy._last_update[2][2]) <= protocol.MAX_REASON_CHARS
    )
    assert len(caplog.text) < 20_000, len(caplog.text)


def test_a_client_claiming_an_older_replica_than_it_was_sent_gets_no_merge_of_the_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A client reporting an old version still in the log, with that version's true digest (every
    downlink names the current one), made the server merge the whole log for it every round (17 s
    of CPU a round for a 10M-parameter model, red-team audit). A client holds the version its last
    message brought it to: any other claim is forgotten, and the full replica (no merge) goes."""
    from fedcomp.flower.replica import ServerReplica

    strategy = make_strategy(**{"downlink-codec": "lattice"})
    clients, model = {n: Client(n) for n in (1, 2, 3)}, tiny_model()
    for rnd in (1, 2, 3):
        model, _ = train_round(strategy, clients, rnd, model)  # type: ignore[assignment]
    assert strategy.replica is not None and strategy.replica.version >= 2
    old = 1

    def lie(node: int, reply: Message) -> Message:
        if node != 2 or not reply.has_content():
            return reply
        up = reply.content.config_records[protocol.UPLINK]
        assert strategy.replica is not None
        fields = {"replica_version": old, "replica_digest": strategy.replica.digest_of(old)}
        return _replace_content(reply, **{protocol.UPLINK: with_fields(up, **fields)})

    model, _ = train_round(strategy, clients, 4, model, tamper=lie)
    merges: list[int] = []
    original = ServerReplica._merge_from
    monkeypatch.setattr(ServerReplica, "_merge_from", lambda self, v: merges.append(v) or original(self, v))
    model, log = train_round(strategy, clients, 5, model, tamper=lie)
    assert mode_of(log.downlinks[2]) == "full" and old not in merges  # (the others: one delta each)
    assert {mode_of(log.downlinks[n]) for n in (1, 3)} == {"chain"}
    with caplog.at_level("WARNING", logger="flwr.fedcomp"):
        _, log = train_round(strategy, clients, 6, model)  # it lied again: full again, said once
    assert mode_of(log.downlinks[2]) == "full"
    assert "node 2 gets the full model again in round 6" in caplog.text


def test_a_known_node_older_than_the_log_gets_the_full_model_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Sampled rarely, a node is older than the delta log and gets the full model each time: no
    fault of its own, so no warning (it was named as one that 'loses its state', a review found)."""
    strategy = make_strategy(**{"delta-log-size": 1})
    clients, model = {n: Client(n) for n in (1, 2)}, tiny_model()
    modes = []
    with caplog.at_level("WARNING", logger="flwr.fedcomp"):
        for rnd in range(1, 8):
            new, log = train_round(strategy, clients, rnd, model, nodes=[1] if rnd % 3 else [1, 2])
            model = new if new is not None else model
            modes += [mode_of(log.downlinks[2])] if 2 in log.downlinks else []
    assert modes == ["full", "full"]  # round 3 (new), round 6 (known, older than the log)
    assert "gets the full model again" not in caplog.text


@pytest.mark.parametrize(
    ("metrics", "rejected"),
    [
        ({f"m{i:05d}": 1.0 for i in range(20_000)}, True),  # many keys
        ({"per-class": [0.5] * 10_000}, True),  # one long list
        ({"k" * 70_000: 1.0}, True),  # one huge key
        ({"per-class": [0.5] * 1_000, "loss": 0.1}, False),  # a user's honest list metric
    ],
    ids=["many-keys", "long-list", "huge-key", "honest-list"],
)
def test_a_reply_with_oversized_metrics_is_rejected_train_and_evaluate(metrics: dict[str, Any], rejected: bool) -> None:
    strategy = make_strategy(**{"uplink-codec": "dense-fp32"})
    clients = {n: Client(n) for n in (1, 2, 3)}

    def bloat(reply: Message) -> Message:
        return _replace_content(reply, metrics=MetricRecord({"num-examples": 10, **metrics}))

    new, _ = train_round(strategy, clients, 1, tiny_model(), tamper=lambda n, r: bloat(r) if n == 2 else r)
    t = strategy.traffic[1]
    assert new is not None and t.accepted == (2 if rejected else 3)
    if rejected:
        assert list(t.rejected) == [2] and "max-metrics-bytes" in t.rejected[2], t.rejected
    strategy, honest = _evaluate_round()
    replies = [bloat(r) if n == 2 else r for n, r in honest.items()]
    assert strategy.aggregate_evaluate(1, replies) is not None
    assert list(strategy.traffic[1].rejected_evaluate) == ([2] if rejected else [])


def test_max_metrics_bytes_is_the_bound() -> None:
    """At the bound a reply passes; one byte past it, it is rejected."""
    strategy = make_strategy(**{"uplink-codec": "dense-fp32", "max-metrics-bytes": 100})
    # "num-examples" (12 + 8) + "x" * 72 (72 + 8) = 100 bytes
    at = MetricRecord({"num-examples": 10, "x" * 72: 1.0})
    past = MetricRecord({"num-examples": 10, "x" * 73: 1.0})
    clients = {n: Client(n) for n in (1, 2, 3)}
    train_round(
        strategy,
        clients,
        1,
        tiny_model(),
        tamper=lambda n, r: (
            _replace_content(r, metrics=at) if n == 1 else _replace_content(r, metrics=past) if n == 2 else r
        ),
    )
    assert list(strategy.traffic[1].rejected) == [2]


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "materialising"])
@pytest.mark.parametrize("uplink", ["topk", "deft"])
def test_a_reply_rejected_for_its_records_adds_nothing_to_the_round_s_selection(uplink: str, streaming: bool) -> None:
    """``uplink_union_density`` counts accepted replies only: a reply whose update decoded and
    passed its checks but whose records did not (an ArrayRecord of its own) was counted before."""
    strategy = make_strategy(**{"uplink-codec": uplink, "topk-density": 0.05})
    strategy.streaming = streaming
    clients = {n: Client(n) for n in (1, 2, 3)}

    def extra_record(node: int, reply: Message) -> Message:
        return _replace_content(reply, extra=ArrayRecord({"x": torch.zeros(3)})) if node == 2 else reply

    _, log = train_round(strategy, clients, 1, tiny_model(), tamper=extra_record)
    t = strategy.traffic[1]
    assert set(t.rejected) == {2} and "ArrayRecord" in t.rejected[2]
    codec = strategy.config.uplink_codec_at(1)
    kept = [
        decode_payload(protocol.UplinkReport.from_record(log.uplinks[n]).payload, tiny_model(), codec) for n in (1, 3)
    ]
    union = sum(int(((kept[0][k] != 0) | (kept[1][k] != 0)).sum()) for k in ("w1", "w2"))
    assert (t.union_nnz, t.sparse_numel) == (union, 2000 + 1200)
    node_2 = decode_payload(protocol.UplinkReport.from_record(log.uplinks[2]).payload, tiny_model(), codec)
    assert sum(int(((node_2[k] != 0) & (kept[0][k] == 0) & (kept[1][k] == 0)).sum()) for k in ("w1", "w2")) > 0
