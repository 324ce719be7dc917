"""Bandwidth awareness: the byte estimate, the default policy, link profiles, and the client mod
applying a choice end to end against the strategy wrapper (no Flower run)."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import FedAvg
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.app.config import AppConfig
from fedcomp.app.models import LeNet5Caffe
from fedcomp.codecs import DenseFP32, TensorSpec, get_codec
from fedcomp.errors import ConfigError
from fedcomp.flower import protocol as keys
from fedcomp.flower.mod import _CodecClock, compression_mod
from fedcomp.flower.settings import CompressionConfig
from fedcomp.flower.strategy import CompressionStrategy
from fedcomp.methods.bandwidth import (
    DENSE_CODEC,
    MESSAGE_OVERHEAD_BYTES,
    BandwidthBudget,
    Choice,
    ClientSituation,
    ConstantTotalSparsity,
    estimate_dense_bytes,
    estimate_sbc_bytes,
    get_policy,
)
from fedcomp.methods.update import UpdateEncoder, decode_update
from fedcomp.net.links import LinkProfile, link_of, parse_link_profiles
from fedcomp.wire.serde import update_from_bytes, update_to_bytes
from tests.flower.helpers import FixedGrid

TENSORS = tuple((k, v.numel()) for k, v in LeNet5Caffe().state_dict().items())
MIN_NUMEL = 1000


def _situation(link: LinkProfile | None = None, **kw: object) -> ClientSituation:
    base = dict(link=link, tensors=TENSORS, min_numel=MIN_NUMEL, p=0.01, local_iters=10)
    return ClientSituation(**{**base, **kw})  # type: ignore[arg-type]


def est(p: float) -> int:
    return estimate_sbc_bytes(TENSORS, p, MIN_NUMEL)


# --- the byte estimate ---------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.0005, 0.001, 0.01, 0.05, 0.2])
def test_estimate_is_close_to_the_real_payload(p: float) -> None:
    torch.manual_seed(1)
    delta = {k: torch.randn_like(v) * 0.01 for k, v in LeNet5Caffe().state_dict().items()}
    enc = UpdateEncoder(get_codec({"id": "sbc", "p": p, "mode": "exact"}), min_numel=MIN_NUMEL, error_feedback=False)
    real = len(update_to_bytes(enc.encode(delta, 3)))
    assert abs(est(p) - real) / real < 0.1, (p, est(p), real)


def test_estimate_grows_with_p() -> None:
    ps = [0.0001 * 1.3**i for i in range(30)]
    sizes = [est(p) for p in ps]
    assert sizes == sorted(sizes) and sizes[-1] > 5 * sizes[0]


# --- the default policy --------------------------------------------------------------------------


def test_no_budget_keeps_the_schedule() -> None:
    c = ConstantTotalSparsity().choose(BandwidthBudget(), _situation(LinkProfile(1, 1)))
    assert (c.p, c.local_iters, c.budget_bytes, c.fits) == (0.01, 10, None, True)
    # A deadline but no link to turn it into bytes: the schedule too.
    c = ConstantTotalSparsity().choose(BandwidthBudget(round_deadline_s=5), _situation(None))
    assert (c.p, c.local_iters, c.budget_bytes) == (0.01, 10, None)


def test_byte_budget_gets_the_largest_p_that_fits() -> None:
    budget = BandwidthBudget(uplink_budget_bytes=7000, p_min=0.0005, p_max=0.2)
    c = ConstantTotalSparsity(margin=0.05).choose(budget, _situation())
    assert c.fits and c.budget_bytes == 7000 and c.local_iters == 10
    # the message's headers take their share of the budget, as they do of the wire
    assert est(c.p) + MESSAGE_OVERHEAD_BYTES <= 0.95 * 7000 < est(c.p * 1.02) + MESSAGE_OVERHEAD_BYTES
    assert c.estimated_bytes == est(c.p)


def test_bounds_clamp_the_choice() -> None:
    policy = ConstantTotalSparsity()
    generous = policy.choose(BandwidthBudget(uplink_budget_bytes=10**9, p_max=0.05), _situation())
    assert (generous.p, generous.fits) == (0.05, True)
    tight = policy.choose(BandwidthBudget(uplink_budget_bytes=100, p_min=0.002), _situation())
    assert (tight.p, tight.fits) == (0.002, False)


def test_deadline_counts_latency_downlink_and_compute() -> None:
    link = LinkProfile(uplink_mbps=1.0, downlink_mbps=2.0, latency_ms=100)
    budget = BandwidthBudget(round_deadline_s=1.0, p_min=0.0001, p_max=0.5)
    c = ConstantTotalSparsity(margin=0).choose(budget, _situation(link, downlink_bytes=50_000, seconds_per_iter=0.03))
    spare = 1.0 - 0.2 - 50_000 * 8 / 2e6 - 10 * 0.03  # 0.3 s left for the upload
    assert c.budget_bytes == int(spare * 1e6 / 8)
    assert est(c.p) + MESSAGE_OVERHEAD_BYTES <= c.budget_bytes < est(c.p * 1.02) + MESSAGE_OVERHEAD_BYTES
    # The same client on a link 10x faster sends a larger p.
    fast = ConstantTotalSparsity(margin=0).choose(
        budget, _situation(LinkProfile(10.0, 20.0, 100), downlink_bytes=50_000, seconds_per_iter=0.03)
    )
    assert fast.p > 3 * c.p


def test_adapting_local_iterations_keeps_total_sparsity() -> None:
    budget = BandwidthBudget(uplink_budget_bytes=7000, p_min=0.0005, p_max=0.2, adapt_local_iters=True,
                             local_iters_min=1, local_iters_max=1000)  # fmt: skip
    c = ConstantTotalSparsity().choose(budget, _situation(p=0.01, local_iters=10))
    assert c.p < 0.01 and c.local_iters == round(c.p / 0.001)  # p / iters stays 0.01 / 10
    assert abs(c.p / c.local_iters - 0.001) / 0.001 < 0.2
    # With a deadline, more iterations cost compute time: a fast link's p is capped by it.
    link = LinkProfile(100.0, 100.0, 0)
    deadline = BandwidthBudget(
        round_deadline_s=2.0, p_min=0.0005, p_max=0.5, adapt_local_iters=True, local_iters_max=1000
    )
    d = ConstantTotalSparsity(margin=0).choose(
        deadline, _situation(link, p=0.01, local_iters=10, seconds_per_iter=0.01)
    )
    assert d.fits and d.local_iters * 0.01 + link.uplink_seconds(d.estimated_bytes) <= 2.0
    assert d.local_iters * 0.01 > 1.5  # most of the deadline goes to compute: bytes are cheap here


def test_iteration_bounds_clamp() -> None:
    budget = BandwidthBudget(uplink_budget_bytes=10**9, p_max=0.5, adapt_local_iters=True, local_iters_max=20)
    c = ConstantTotalSparsity().choose(budget, _situation(p=0.01, local_iters=10))
    assert (c.p, c.local_iters) == (0.5, 20)


@settings(max_examples=60, deadline=None)
@given(small=st.integers(200, 100_000), extra=st.integers(0, 100_000), adapt=st.booleans())
def test_more_budget_never_means_a_smaller_p(small: int, extra: int, adapt: bool) -> None:
    policy = ConstantTotalSparsity()
    kw = dict(p_min=0.0005, p_max=0.3, adapt_local_iters=adapt, local_iters_max=200)
    a = policy.choose(BandwidthBudget(uplink_budget_bytes=small, **kw), _situation())  # type: ignore[arg-type]
    b = policy.choose(BandwidthBudget(uplink_budget_bytes=small + extra, **kw), _situation())  # type: ignore[arg-type]
    assert b.p >= a.p * (1 - 1e-9)
    if a.fits:
        assert a.estimated_bytes <= 0.95 * small


def test_budget_record_roundtrip_and_checks() -> None:
    b = BandwidthBudget(round_deadline_s=2.5, uplink_budget_bytes=10, link_profiles="1,2,3")
    assert BandwidthBudget.from_json(b.to_json()) == b
    with pytest.raises(ConfigError, match="sbc-p-min/sbc-p-max"):
        BandwidthBudget(p_min=0.2, p_max=0.1)
    with pytest.raises(ConfigError, match="bandwidth"):
        BandwidthBudget.from_json('{"nope": 1}')
    with pytest.raises(ConfigError, match="unknown policy"):
        get_policy("nope")


def test_run_config_keys_validate() -> None:
    cfg = AppConfig.from_run_config({"round-deadline-s": 3, "link-profiles": "10,10,5", "sbc-p-min": 0.002}).compression
    budget = cfg.bandwidth_budget()
    assert budget.active and budget.round_deadline_s == 3.0 and budget.p_min == 0.002
    for bad, msg in [
        ({"sbc-p-min": 0.2, "sbc-p-max": 0.1}, "sbc-p-max: must be >= sbc-p-min"),
        ({"link-profiles": "10"}, "link-profiles: profile 0"),
        ({"local-iters-min": 5, "local-iters-max": 2}, "local-iters-max: must be >= local-iters-min"),
        ({"bandwidth-policy": "greedy"}, "bandwidth-policy: unknown policy"),
        ({"uplink-budget-bytes": -1}, "uplink-budget-bytes"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            AppConfig.from_run_config(bad)


# --- links ---------------------------------------------------------------------------------------


def test_link_of_prefers_the_node_config_then_cycles_profiles() -> None:
    profiles = parse_link_profiles("10,10,20;100,100,5")
    assert link_of({"partition-id": 3}, profiles) == LinkProfile(100, 100, 5)
    assert link_of({"partition-id": 4}, profiles) == LinkProfile(10, 10, 20)
    assert link_of({"partition-id": 4, "uplink-mbps": 1.0, "downlink-mbps": 2}, profiles) == LinkProfile(1, 2, 0)
    assert link_of({}, []) is None
    with pytest.raises(ConfigError, match="node config: downlink-mbps: missing"):
        link_of({"uplink-mbps": 1.0}, profiles)
    link = LinkProfile(8.0, 16.0, 0)
    assert link.uplink_seconds(1_000_000) == 1.0 and link.downlink_seconds(2_000_000) == 1.0
    assert math.isclose(link.uplink_bytes_in(0.5), 500_000)


# --- the mod applies the choice (strategy -> mod -> strategy, no Flower run) ---------------------


@pytest.fixture(autouse=True)
def _server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a ServerApp process has set when its strategy builds messages."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)


def _round_trip(
    run_config: dict, node_config: dict, context: Context | None = None
) -> tuple[Message, CompressionStrategy, dict]:
    comp = CompressionConfig.from_run_config(run_config)
    strategy = CompressionStrategy(FedAvg(min_available_nodes=1, min_train_nodes=1), comp)
    model = LeNet5Caffe()
    arrays = ArrayRecord(model.state_dict())
    (out,) = strategy.configure_train(1, arrays, ConfigRecord({"lr": 0.001}), FixedGrid([7]))
    if context is None:
        context = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})
    seen: dict = {}

    def train(msg: Message, ctx: Context) -> Message:
        seen["local-iters"] = msg.content["config"]["local-iters"]
        state = msg.content["arrays"].to_torch_state_dict()
        trained = {k: v + 0.01 * torch.randn_like(v) for k, v in state.items()}
        seen["delta"] = {k: trained[k] - state[k] for k in state}
        content = RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": 10})})
        return Message(content, reply_to=msg)

    reply = compression_mod(out, context, train)
    return reply, strategy, seen


def test_mod_picks_p_and_iterations_and_the_strategy_records_them() -> None:
    run_config = {"sbc-p": 0.01, "uplink-budget-bytes": 7000, "sbc-p-min": 0.0005, "sbc-p-max": 0.2, "adapt-local-iters": True,
                  "local-iters-max": 1000, "link-profiles": "10,10,20"}  # fmt: skip
    reply, strategy, seen = _round_trip(run_config, {"partition-id": 0, "num-partitions": 1})
    up = reply.content.config_records[keys.UPLINK]
    p, iters = up["sbc-p"], up["local-iters"]
    assert p < 0.01 and iters == seen["local-iters"] == round(p / 0.001)
    assert up["budget-bytes"] == 7000 and up["fits"] is True
    # the real payload and the message's headers honour the budget (5 % margin)
    assert len(up["payload"]) + MESSAGE_OVERHEAD_BYTES <= 7000 * 1.05
    assert (up["uplink-mbps"], up["downlink-mbps"], up["latency-ms"]) == (10.0, 10.0, 20.0)
    strategy.aggregate_train(1, [reply])
    t = strategy.traffic[1]
    assert t.rejected == {}
    node = next(iter(t.sbc_p))
    assert t.sbc_p[node] == p and t.local_iters[node] == iters and t.budget_bytes[node] == 7000
    assert t.links[node] == [10.0, 10.0, 20.0] and t.train_seconds[node] >= 0


def test_mod_without_a_budget_keeps_the_schedule_and_still_reports() -> None:
    reply, _, seen = _round_trip(
        {"sbc-p": 0.01}, {"partition-id": 0, "num-partitions": 1, "uplink-mbps": 5.0, "downlink-mbps": 50.0}
    )
    up = reply.content.config_records[keys.UPLINK]
    assert up["sbc-p"] == 0.01 and up["local-iters"] == seen["local-iters"] == 10
    # A known link runs the policy (dense where that is sooner), but without a budget nothing is capped.
    assert "budget-bytes" not in up and up["fits"] is True
    assert (up["uplink-mbps"], up["downlink-mbps"], up["latency-ms"]) == (5.0, 50.0, 0.0)


def _lenet_numel() -> int:
    return sum(n for _, n in TENSORS)


def test_the_mod_measures_its_codec_time() -> None:
    """After one bandwidth-aware round the client holds its own codec seconds: its SBC encode
    (the time it reports) and a few dense fp32 encodes timed on purpose."""
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                      run_config={})  # fmt: skip
    reply, _, _ = _round_trip({"sbc-p": 0.01, "link-profiles": "10,10,0"}, {}, context)
    up = reply.content.config_records[keys.UPLINK]
    clock = _CodecClock(context)
    assert clock.best("sbc") == up["encode-seconds"] and clock.count("sbc") == 1
    assert clock.count("dense-fp32") == 3 and (clock.best("dense-fp32") or 0.0) > 0
    assert clock.best("downlink") is None  # round 1's downlink is the full model, not a round's delta
    seconds = dict(clock.codec_seconds("sbc", "dense-fp32"))
    assert seconds == {"sbc": clock.best("sbc"), "dense-fp32": clock.best("dense-fp32")}


def test_the_mod_times_a_rounds_downlink_once_it_serves_the_policy() -> None:
    """Round 2's downlink is a delta chain: the client times applying it (round 1's was the full
    model), and the next round's codec seconds include it."""
    comp = CompressionConfig.from_run_config({"sbc-p": 0.01, "link-profiles": "10,10,0"})
    strategy = CompressionStrategy(FedAvg(min_available_nodes=1, min_train_nodes=1), comp)
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                      run_config={})  # fmt: skip

    def train(msg: Message, ctx: Context) -> Message:
        state = msg.content["arrays"].to_torch_state_dict()
        trained = {k: v + 0.01 * torch.randn_like(v) for k, v in state.items()}
        content = RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": 10})})
        return Message(content, reply_to=msg)

    arrays = ArrayRecord(LeNet5Caffe().state_dict())
    for rnd in (1, 2):
        (out,) = strategy.configure_train(rnd, arrays, ConfigRecord({"lr": 0.001}), FixedGrid([7]))
        reply = compression_mod(out, context, train)
        assert not reply.has_error()
        new, _ = strategy.aggregate_train(rnd, [reply])
        assert new is not None
        arrays = new
        clock = _CodecClock(context)
        assert (clock.count("downlink"), clock.count("sbc")) == (rnd - 1, rnd)
    down = clock.best("downlink")
    assert down is not None and down > 0
    assert dict(clock.codec_seconds("sbc"))["sbc"] == pytest.approx(down + (clock.best("sbc") or 0.0))


def test_a_fast_client_sends_its_whole_update_dense_and_the_server_takes_it() -> None:
    """Codec seconds that make dense sooner on a 1 Tbit/s link: the mod sends every tensor as
    dense fp32, residual included (so none is left), and the strategy aggregates the reply."""
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                      run_config={})  # fmt: skip
    clock = _CodecClock(context)
    clock.note("sbc", 0.05)
    clock.note("dense-fp32", 0.001)
    torch.manual_seed(3)
    residual = {k: torch.randn_like(v) * 1e-3 for k, v in LeNet5Caffe().state_dict().items() if v.numel() >= MIN_NUMEL}
    context.state[keys.STATE_RESIDUAL] = ArrayRecord({k: v.clone() for k, v in residual.items()})
    reply, strategy, seen = _round_trip({"sbc-p": 0.01, "link-profiles": "1000000,1000000,0"}, {}, context)
    up = reply.content.config_records[keys.UPLINK]
    assert "sbc-p" not in up and up["estimated-bytes"] == DENSE_BYTES
    update = update_from_bytes(up["payload"])
    assert {t.codec_id for t in update.tensors} == {"dense-fp32"} and len(up["payload"]) > 4 * _lenet_numel()
    specs = [TensorSpec(k, tuple(v.shape), torch.float32) for k, v in seen["delta"].items()]
    sent = decode_update(update, specs, [DenseFP32()])
    for k, d in seen["delta"].items():
        torch.testing.assert_close(sent[k], d + residual.get(k, torch.zeros_like(d)), rtol=0, atol=1e-7)
    left = context.state.array_records[keys.STATE_RESIDUAL].to_torch_state_dict()
    assert all(float(t.abs().max()) == 0.0 for t in left.values())
    strategy.aggregate_train(1, [reply])
    assert strategy.traffic[1].rejected == {} and strategy.traffic[1].uplink
    # The same client on a 10 Mbit/s link: 1.4 s of dense bytes against SBC's 0.05 s: it compresses.
    slow = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                   run_config={})  # fmt: skip
    _CodecClock(slow).note("sbc", 0.05)
    _CodecClock(slow).note("dense-fp32", 0.001)
    reply, _, _ = _round_trip({"sbc-p": 0.01, "link-profiles": "10,10,0"}, {}, slow)
    up = reply.content.config_records[keys.UPLINK]
    assert up["sbc-p"] == 0.01 and "sbc" in {t.codec_id for t in update_from_bytes(up["payload"]).tensors}


# --- codec time counted: dense when it uploads sooner ------------------------------------------

DENSE_BYTES = estimate_dense_bytes(TENSORS)
#: Codec seconds of one LeNet5 update: SBC (select, Golomb, and the server's decode) vs a copy.
CODEC_SECONDS = (("sbc", 0.05), ("dense-fp32", 0.004))


def _upload_seconds(c: Choice, link: LinkProfile) -> float:
    codec = "sbc" if c.codec is None else str(c.codec["id"])
    return dict(CODEC_SECONDS)[codec] + link.uplink_seconds(c.estimated_bytes)


def test_a_fast_link_gets_dense_once_codec_time_counts() -> None:
    policy, budget = ConstantTotalSparsity(), BandwidthBudget()
    fast, slow = LinkProfile(1000.0, 1000.0, 0), LinkProfile(10.0, 10.0, 0)
    on_fast = policy.choose(budget, _situation(fast, codec_seconds=CODEC_SECONDS))
    assert on_fast.codec == DENSE_CODEC and on_fast.estimated_bytes == DENSE_BYTES
    assert "dense fp32 uploads sooner" in on_fast.reason
    assert _upload_seconds(on_fast, fast) < dict(CODEC_SECONDS)["sbc"]  # dense beats SBC's codec time alone
    on_slow = policy.choose(budget, _situation(slow, codec_seconds=CODEC_SECONDS))
    assert on_slow.codec is None and on_slow.p == 0.01  # 1.4 s of dense bytes vs 0.05 s of SBC
    # Without measured codec time, bytes alone decide: SBC even on the fast link.
    assert policy.choose(budget, _situation(fast)).codec is None
    # A byte budget dense would break keeps the sparse choice, however fast the link.
    capped = policy.choose(
        BandwidthBudget(uplink_budget_bytes=DENSE_BYTES - 1), _situation(fast, codec_seconds=CODEC_SECONDS)
    )
    assert capped.codec is None


@settings(max_examples=60, deadline=None)
@given(mbps=st.floats(0.1, 10_000.0), sbc_s=st.floats(0.0, 1.0), dense_s=st.floats(0.0, 1.0))
def test_the_choice_never_uploads_slower_than_dense(mbps: float, sbc_s: float, dense_s: float) -> None:
    link = LinkProfile(mbps, mbps, 0)
    seconds = (("sbc", sbc_s), ("dense-fp32", dense_s))
    c = ConstantTotalSparsity().choose(BandwidthBudget(), _situation(link, codec_seconds=seconds))
    codec = "sbc" if c.codec is None else "dense-fp32"
    took = dict(seconds)[codec] + link.uplink_seconds(c.estimated_bytes)
    assert took <= dense_s + link.uplink_seconds(DENSE_BYTES) + 1e-12


def test_a_deadline_pays_the_codec_time_too() -> None:
    link = LinkProfile(uplink_mbps=1.0, downlink_mbps=1.0, latency_ms=0)
    budget = BandwidthBudget(round_deadline_s=0.3, p_min=0.0001, p_max=0.5)
    without = ConstantTotalSparsity(margin=0).choose(budget, _situation(link))
    # Only SBC measured (no dense figure): the deadline's upload time shrinks by its 0.2 s.
    counted = ConstantTotalSparsity(margin=0).choose(budget, _situation(link, codec_seconds=(("sbc", 0.2),)))
    assert without.budget_bytes == int(0.3 * 1e6 / 8)
    assert counted.budget_bytes is not None and abs(counted.budget_bytes - 0.1 * 1e6 / 8) <= 1
    assert counted.p < without.p and counted.codec is None
