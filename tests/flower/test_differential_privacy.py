"""Flower's central differential privacy around the compression wrapper and mod.

Server-side clipping (``DifferentialPrivacyServerSideFixedClipping``) clips each reply's update
against the model it configured: inside ``CompressionStrategy`` that is the server's exact model
and the decoded update, so with lossless codecs the wrapped run equals the plain one. Client-side
clipping (``DifferentialPrivacyClientSideFixedClipping``) calibrates its noise to the
``clipping_norm`` it sends: ``compression_mod`` must keep what it *sends* (update plus residual,
after the codec) within that norm, which ``fixedclipping_mod`` alone does not (pinned below).
Noise multipliers are 0 so that runs are deterministic; the noise itself is Flower's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    Strategy,
)

import fedcomp.flower.mod as mod_module
from fedcomp.errors import ConfigError
from fedcomp.flower import protocol
from fedcomp.flower.clipping import CLIPPING_NORM_KEY, clipping_norm_of
from fedcomp.flower.mod import compression_mod
from fedcomp.flower.records import record_from_tensors, tensors_from_record
from fedcomp.flower.settings import CompressionConfig
from fedcomp.flower.strategy import CompressionStrategy
from tests.flower.helpers import (
    ARRAYS,
    METRICS,
    SAMPLE_ALL,
    Client,
    FixedGrid,
    decode_payload,
    local_delta,
    max_abs_diff,
    server_identity,
    tiny_model,
    train_round,
)

__all__ = ["server_identity"]  # the autouse fixture, imported so it applies here

NODES = (1, 2, 3)
ROUNDS = 5
CLIP = 0.05
LOSSLESS = {"uplink-codec": "identity", "downlink-codec": "identity"}


def _norm(tensors: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(math.fsum(float(t.double().pow(2).sum()) for t in tensors.values()))


class SteadyClient(Client):
    """Trains in the same direction every round (as real training does for many rounds), at 4x
    the clipping norm: error feedback then carries a residual that grows round after round."""

    def direction(self, msg: Message) -> int:
        """Which of ``local_delta``'s directions this round's update takes."""
        return 0

    def app(self, msg: Message, ctx: Context) -> Message:
        received = tensors_from_record(msg.content.array_records[ARRAYS])
        d = local_delta(self.node, self.direction(msg), received)
        scale = 4 * CLIP / _norm(d)
        trained = {k: received[k] + d[k] * scale for k in received}
        content = RecordDict({ARRAYS: record_from_tensors(trained), METRICS: MetricRecord({"num-examples": 10})})
        return Message(content, reply_to=msg)


class RandomClient(SteadyClient):
    """A new direction every round, still at 4x the clipping norm."""

    def direction(self, msg: Message) -> int:
        return int(msg.content.config_records[protocol.CONFIG_RECORD][protocol.SERVER_ROUND])  # type: ignore[arg-type]


class FlowerClippedClient(SteadyClient):
    """Flower's ``fixedclipping_mod`` inside ``compression_mod``: it clips the trained update."""

    def handle(self, msg: Message) -> Message:
        return compression_mod(msg, self.ctx, lambda m, c: fixedclipping_mod(m, c, self.app))


def _sent_norms(strategy: CompressionStrategy, logs: list, rounds: int, first_round: int = 1) -> list[float]:
    """The L2 norm of every uplink as the server decodes it, all rounds, all clients (in node
    order within a round)."""
    norms = []
    for rnd, log in enumerate(logs, start=first_round):
        codec = strategy.config.uplink_codec_at(rnd)
        for rec in log.uplinks.values():
            payload = protocol.UplinkReport.from_record(rec).payload
            assert payload is not None
            norms.append(_norm(decode_payload(payload, tiny_model(), codec)))
    assert len(norms) == rounds * len(NODES)
    return norms


def _run(
    inner: Strategy, clients: Mapping[int, Client], rounds: int = ROUNDS, **run_config: object
) -> tuple[CompressionStrategy, dict[str, torch.Tensor], list]:
    strategy = CompressionStrategy(inner, CompressionConfig.from_run_config(run_config))
    model, logs = tiny_model(), []
    for rnd in range(1, rounds + 1):
        new, log = train_round(strategy, clients, rnd, model)
        assert new is not None and strategy.traffic[rnd].rejected == {}
        model = new
        logs.append(log)
    return strategy, model, logs


def _plain(inner: Strategy, handle: Callable[[int, Message], Message], rounds: int = ROUNDS) -> dict[str, torch.Tensor]:
    """``inner`` with no wrapper: ``handle(node, msg)`` answers each train message."""
    model = tiny_model()
    for rnd in range(1, rounds + 1):
        msgs = inner.configure_train(rnd, record_from_tensors(model), ConfigRecord({}), FixedGrid(NODES))
        replies = [handle(m.metadata.dst_node_id, m) for m in msgs]
        arrays, _ = inner.aggregate_train(rnd, replies)
        assert arrays is not None
        model = tensors_from_record(arrays)
    return model


def _client_dp(inner: Strategy | None = None) -> DifferentialPrivacyClientSideFixedClipping:
    return DifferentialPrivacyClientSideFixedClipping(
        inner or FedAvg(**SAMPLE_ALL), noise_multiplier=0.0, clipping_norm=CLIP, num_sampled_clients=len(NODES)
    )


def test_the_key_is_flowers_and_a_bad_value_is_a_config_error() -> None:
    from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

    assert CLIPPING_NORM_KEY == KEY_CLIPPING_NORM
    assert clipping_norm_of(ConfigRecord({})) is None and clipping_norm_of(None) is None
    assert clipping_norm_of(ConfigRecord({CLIPPING_NORM_KEY: 2})) == 2.0
    for bad in (0.0, -1.0, math.inf, math.nan, True, "1"):
        with pytest.raises(ConfigError, match=CLIPPING_NORM_KEY):
            clipping_norm_of({CLIPPING_NORM_KEY: bad})


def test_server_side_clipping_through_lossless_codecs_equals_the_plain_run() -> None:
    def dp() -> DifferentialPrivacyServerSideFixedClipping:
        return DifferentialPrivacyServerSideFixedClipping(
            FedAvg(**SAMPLE_ALL), noise_multiplier=0.0, clipping_norm=CLIP, num_sampled_clients=len(NODES)
        )

    clients = {n: SteadyClient(n) for n in NODES}
    _, wrapped, _ = _run(dp(), clients, **LOSSLESS)
    plain = _plain(dp(), lambda n, m: SteadyClient(n).app(m, Context(1, n, {}, RecordDict(), {})))
    unclipped = _plain(FedAvg(**SAMPLE_ALL), lambda n, m: SteadyClient(n).app(m, Context(1, n, {}, RecordDict(), {})))
    assert max_abs_diff(wrapped, plain) < 1e-6
    assert max_abs_diff(plain, unclipped) > 1e-2  # the clip bound: the equality is not FedAvg's


def test_server_side_clipping_with_compression_bounds_each_step_by_the_norm() -> None:
    """SBC up, 3LC down: the server clips each decoded update against its own model, so the mean
    of the clipped updates (noise 0) moves the model by at most the clipping norm."""
    dp = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(**SAMPLE_ALL), noise_multiplier=0.0, clipping_norm=CLIP, num_sampled_clients=len(NODES)
    )
    strategy = CompressionStrategy(dp, CompressionConfig.from_run_config({"sbc-p": 0.2}))
    clients, model = {n: SteadyClient(n) for n in NODES}, tiny_model()
    for rnd in range(1, ROUNDS + 1):
        new, _ = train_round(strategy, clients, rnd, model)
        assert new is not None
        step = _norm({k: new[k].double() - model[k].double() for k in model})
        assert 0.5 * CLIP < step <= CLIP * (1 + 1e-6)
        model = new


@pytest.mark.parametrize("codec", ["sbc", "topk", "stc", "deft", "dense-fp16", "dense-fp32", "identity"])
def test_client_side_clipping_bounds_what_is_sent_residual_included(codec: str) -> None:
    config = {"uplink-codec": codec, "sbc-p": 0.2, "topk-density": 0.2}
    clients = {n: SteadyClient(n) for n in NODES}
    strategy, _, logs = _run(_client_dp(), clients, **config)
    norms = _sent_norms(strategy, logs, ROUNDS)
    assert max(norms) <= CLIP
    # The bound binds: without DP the same clients send more than it every round ...
    free, _, free_logs = _run(FedAvg(**SAMPLE_ALL), {n: SteadyClient(n) for n in NODES}, **config)
    assert min(_sent_norms(free, free_logs, ROUNDS)) > 1.5 * CLIP
    # ... and a lossless (or nearly) codec sends the clipped accumulator itself, at the bound.
    if codec in ("dense-fp16", "dense-fp32", "identity"):
        assert min(norms) > (1 - 2e-3) * CLIP
    if codec in ("sbc", "topk", "stc", "deft"):
        residuals = [tensors_from_record(c.ctx.state.array_records[protocol.STATE_RESIDUAL]) for c in clients.values()]
        assert all(_norm(r) > 0 for r in residuals)  # error feedback is on


@pytest.mark.parametrize("codec", ["sbc", "topk", "stc", "deft"])
def test_under_clipping_the_residual_stays_within_a_few_norms(codec: str) -> None:
    """Twelve rounds of updates at 4x the norm, all one way: a message that would be longer than
    the norm is scaled down with its residual, and what is scaled away is dropped, so the residual
    levels off (measured: 0.7-2.6x the norm) instead of gaining the surplus every round."""
    clients = {n: SteadyClient(n) for n in NODES}
    config = {"uplink-codec": codec, "sbc-p": 0.2, "topk-density": 0.2}
    strategy = CompressionStrategy(_client_dp(), CompressionConfig.from_run_config(config))
    model, norms = tiny_model(), []
    for rnd in range(1, 13):
        new, _ = train_round(strategy, clients, rnd, model)
        assert new is not None
        model = new
        norms.append(_norm(tensors_from_record(clients[1].ctx.state.array_records[protocol.STATE_RESIDUAL])))
    assert max(norms) <= 4 * CLIP and max(norms[6:]) <= 2 * max(norms[:6])


def test_fixedclipping_mod_alone_lets_the_residual_through_and_the_server_rejects_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Why the mod clips: with its clip switched off, Flower's mod clips each trained update to the
    norm, and SBC's error feedback still sends more than the norm (the residual of earlier rounds).
    The server, whose noise is calibrated to the norm, rejects each such reply, naming the norm."""
    monkeypatch.setattr(mod_module, "clipping_norm_of", lambda config: None)
    config = {"sbc-p": 0.2, "max-empty-rounds": 100}  # (rounds whose replies are all rejected: the point)
    strategy = CompressionStrategy(_client_dp(), CompressionConfig.from_run_config(config))
    clients, model, logs = {n: FlowerClippedClient(n) for n in NODES}, tiny_model(), []
    for rnd in range(1, ROUNDS + 1):
        new, log = train_round(strategy, clients, rnd, model)
        logs.append(log)
        sent = _sent_norms(strategy, [log], 1, first_round=rnd)
        over = {n for n, norm in zip(log.uplinks, sent, strict=True) if norm > CLIP}
        rejected = strategy.traffic[rnd].rejected
        assert set(rejected) == over and all("clipping_norm" in why for why in rejected.values())
        model = new if new is not None else model
    assert max(_sent_norms(strategy, logs, ROUNDS)) > 1.5 * CLIP  # measured: 1.73x by round 5


def test_client_side_clipping_with_lossless_codecs_equals_flowers_mod() -> None:
    """No residual, nothing lost: the mod's clip is Flower's ``fixedclipping_mod``'s."""
    clients = {n: SteadyClient(n) for n in NODES}
    _, wrapped, _ = _run(_client_dp(), clients, **LOSSLESS)

    def flower(node: int, msg: Message) -> Message:
        ctx = Context(1, node, {}, RecordDict(), {})
        return fixedclipping_mod(msg, ctx, SteadyClient(node).app)

    assert max_abs_diff(wrapped, _plain(_client_dp(), flower)) < 1e-6


def test_adaptive_clipping_adapts_and_every_reply_stays_within_its_rounds_norm() -> None:
    """``adaptiveclipping_mod`` inside ``compression_mod`` reports the norm bit; the mod keeps each
    round's uplink within that round's (changing) clipping norm."""
    dp = DifferentialPrivacyClientSideAdaptiveClipping(
        FedAvg(**SAMPLE_ALL),
        noise_multiplier=0.0,
        num_sampled_clients=len(NODES),
        initial_clipping_norm=CLIP,
        clipped_count_stddev=0.0,
    )

    class Adaptive(SteadyClient):
        def handle(self, msg: Message) -> Message:
            return compression_mod(msg, self.ctx, lambda m, c: adaptiveclipping_mod(m, c, self.app))

    strategy = CompressionStrategy(dp, CompressionConfig.from_run_config({"sbc-p": 0.2}))
    clients, model, bounds = {n: Adaptive(n) for n in NODES}, tiny_model(), []
    for rnd in range(1, ROUNDS + 1):
        bound = dp.clipping_norm
        new, log = train_round(strategy, clients, rnd, model)
        assert new is not None and strategy.traffic[rnd].rejected == {}  # the server checks the round's norm
        codec = strategy.config.uplink_codec_at(rnd)
        for rec in log.uplinks.values():
            payload = protocol.UplinkReport.from_record(rec).payload
            assert payload is not None
            assert _norm(decode_payload(payload, tiny_model(), codec)) <= bound
        bounds.append(bound)
        model = new
    # Every update was over the norm and each reply's norm bit said so: Flower 1.41's rule moves the
    # norm down when more than its target fraction (0.5) was clipped; with no bit (none clipped) the
    # norm would have grown.
    assert bounds[-1] < 0.9 * bounds[0]


def test_client_side_clipping_holds_for_gradiveq_whose_decoding_adds_a_mean() -> None:
    """GradiVeQ decodes ``mu + U c``, whose norm is not proportional to its input's: the mod steps
    by the secant until what it would send fits (measured: four encodings in four of the six
    rounds). One client: the server's step is then that client's decoded update (noise 0)."""
    dp = DifferentialPrivacyClientSideFixedClipping(
        FedAvg(**SAMPLE_ALL), noise_multiplier=0.0, clipping_norm=CLIP, num_sampled_clients=1
    )
    config = {"uplink-codec": "gradiveq", "gradiveq-dense-rounds": 2, "gradiveq-eps": 0.3}
    strategy = CompressionStrategy(dp, CompressionConfig.from_run_config(config))
    clients, model, steps = {1: RandomClient(1)}, tiny_model(), []
    for rnd in range(1, 7):
        new, log = train_round(strategy, clients, rnd, model)
        assert new is not None and strategy.traffic[rnd].rejected == {}
        steps.append(_norm({k: new[k].double() - model[k].double() for k in model}))
        model = new
    assert max(steps) <= CLIP * (1 + 1e-6) and min(steps) > 0.5 * CLIP


def test_a_message_that_cannot_be_fitted_is_not_sent_and_the_state_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """One encoding allowed: the first, at 4x the norm, does not fit, so the client replies an
    error instead of its update and keeps its residual as it was."""
    strategy = CompressionStrategy(_client_dp(), CompressionConfig.from_run_config({"sbc-p": 0.2}))
    clients = {n: SteadyClient(n) for n in NODES}
    model, _ = train_round(strategy, clients, 1, tiny_model())
    assert model is not None
    before = {n: dict(c.ctx.state.array_records[protocol.STATE_RESIDUAL]) for n, c in clients.items()}
    monkeypatch.setattr(mod_module, "_CLIP_TRIES", 1)
    _, log = train_round(strategy, clients, 2, model)
    for n, reply in log.replies.items():
        assert reply.has_error() and "clipping_norm" in reply.error.reason
        assert dict(clients[n].ctx.state.array_records[protocol.STATE_RESIDUAL]) == before[n]


@pytest.mark.parametrize("tamper", ["extra-metric-key", "weight-nan"])
def test_a_hostile_reply_is_handled_through_a_dp_wrapper_and_the_round_goes_on(tamper: str) -> None:
    """The wrapper's reply checks read FedAvg's ``weighted_by_key`` through the DP wrapper: an odd
    MetricRecord (which FedAvg would raise on, ending the run) is made like the others' and its
    update aggregated; a weight that is not a number is rejected, and the others are aggregated."""

    def hostile(node: int, reply: Message) -> Message:
        if node != 3:
            return reply
        name, rec = next(iter(reply.content.metric_records.items()))
        changed = {**dict(rec), "extra": 1.0} if tamper == "extra-metric-key" else {"num-examples": math.nan}
        content = RecordDict(dict(reply.content.items()))
        content[name] = MetricRecord(changed)
        reply.content = content
        return reply

    strategy = CompressionStrategy(_client_dp(), CompressionConfig.from_run_config({"sbc-p": 0.2}))
    clients = {n: SteadyClient(n) for n in NODES}
    new, _ = train_round(strategy, clients, 1, tiny_model(), tamper=hostile)
    t = strategy.traffic[1]
    if tamper == "extra-metric-key":
        assert new is not None and t.accepted == 3 and not t.rejected, t.rejected
    else:
        assert new is not None and t.accepted == 2 and list(t.rejected) == [3], t.rejected
