"""``max-update-norm-factor``: a bound on each update's norm that the user need not pick. Round 1
bounds by the model's own norm (no honest update is known yet), later rounds by the median norm
of the last aggregated round's updates; the downlink carries the bound, honest clients keep
within it, and a client that ignores it is rejected while the round goes on."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ConfigRecord, Message
from pydantic import ValidationError

from fedcomp.errors import PayloadError
from fedcomp.flower import mod as mod_module
from fedcomp.flower import protocol
from fedcomp.flower.records import not_finite_and_norm, record_from_tensors
from fedcomp.flower.settings import CompressionConfig
from fedcomp.flower.traffic import metric_record
from tests.flower.helpers import (  # noqa: F401  (server_identity: autouse fixture)
    Client,
    FixedGrid,
    make_strategy,
    n_params,
    server_identity,
    tiny_model,
    train_round,
    with_fields,
)
from tests.flower.test_hostile_replies import _huge_payload

FACTOR = 4.0


def _bound_of(log_downlink: ConfigRecord) -> float:
    return protocol.DownlinkHeader.from_record(log_downlink).max_update_norm


def test_round_one_rejects_an_update_of_1e30_by_the_rounds_own_median() -> None:
    """Before any update is known the downlink carries the factor times the model's norm, and the
    round's own updates tighten it to the factor times their median: one client's update of 1e30
    (under a 3LC downlink, which has no grid to leave) is rejected, the two others are aggregated.
    Without the factor the same update became the model."""
    model = tiny_model()
    for factor in (FACTOR, 0.0):
        strategy = make_strategy(**{"downlink-codec": "3lc", "max-update-norm-factor": factor})
        clients = {n: Client(n) for n in (1, 2, 3)}
        new, log = train_round(strategy, clients, 1, model, tamper=lambda n, r: _huge_payload(r) if n == 2 else r)
        assert new is not None
        t = strategy.traffic[1]
        if factor:
            sent = factor * not_finite_and_norm(model)[1]
            assert _bound_of(log.downlinks[1]) == pytest.approx(sent, rel=1e-12)
            assert list(t.rejected) == [2], t.rejected
            assert "max-update-norm-factor 4 x the median of this round's updates" in t.rejected[2]
            assert t.accepted == 2 and max(float(v.abs().max()) for v in new.values()) < 10
            checked = factor * max(t.update_norm.values())  # (the middle of three: the larger honest one)
            assert checked < sent / 10
            assert metric_record(t, strategy.traffic)["fedcomp.update-norm-bound"] == pytest.approx(checked)
        else:
            assert _bound_of(log.downlinks[1]) == 0.0 and not t.rejected
            assert max(float(v.abs().max()) for v in new.values()) > 1e28  # (the control: poisoned)
            assert "fedcomp.update-norm-bound" not in metric_record(t, strategy.traffic)


@pytest.mark.parametrize("uplink", ["sbc", "dense-fp32", "gradiveq"])
def test_later_rounds_bound_by_the_median_of_the_last_rounds_updates(uplink: str) -> None:
    """Round r's downlinks carry factor x the (lower) median norm of round r-1's aggregated
    updates; honest clients are never rejected; a client sending 50-100x the bound is, in the
    round it does, and the others' updates are aggregated."""
    strategy = make_strategy(**{"uplink-codec": uplink, "max-update-norm-factor": FACTOR})
    clients, model = {n: Client(n) for n in (1, 2, 3, 4)}, tiny_model()
    numel = n_params(model)
    for rnd in range(1, 6):
        before = strategy.traffic[rnd - 1].update_norm if rnd > 1 else {}
        bound = strategy._bound if rnd > 1 else 0.0  # (round 1: the model's norm, tested above)

        def tamper(node: int, reply: Message, rnd: int = rnd) -> Message:
            if rnd == 2 and node == 3:  # (GradiVeQ's rounds 1-2 are dense)
                return _huge_payload(reply, magnitude=100 * strategy._bound / math.sqrt(numel))
            return reply

        new, log = train_round(strategy, clients, rnd, model, tamper=tamper)
        t = strategy.traffic[rnd]
        if rnd > 1:
            norms = sorted(before.values())
            assert len(norms) >= 3 and _bound_of(log.downlinks[1]) == pytest.approx(
                FACTOR * norms[(len(norms) - 1) // 2], rel=1e-12
            )
            bound = _bound_of(log.downlinks[1])
            assert f"round {rnd - 1}'s reference norm" in strategy._bound_why
        if rnd == 2:
            assert list(t.rejected) == [3] and "this round's bound" in t.rejected[3], t.rejected
            assert t.accepted == 3
        else:
            assert not t.rejected and t.accepted == 4, t.rejected
        assert rnd == 1 or all(v <= bound * (1 + 1e-9) for v in t.update_norm.values())
        assert new is not None
        model = new


class _FarClient(Client):
    """An honest client whose training moves the model 10x as far as the others' (its data is
    unlike theirs): over factor 2 x their median every round."""

    def replied(self, received: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: received[k] + 10 * (trained[k] - received[k]) for k in received}


def test_an_honest_outlier_keeps_within_a_tight_factor_and_is_never_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """At factor 2 an honest client that trains 10x as far as the others is over the bound every
    round: its mod clips what it sends (the rest stays in its residual), so it is never rejected
    and its updates are aggregated. A client that ignores the bound is rejected."""
    for clips in (True, False):
        if not clips:
            monkeypatch.setattr(mod_module, "_max_update_norm", lambda dl: None)
        strategy = make_strategy(**{"max-update-norm-factor": 2.0, "max-empty-rounds": 9})
        clients, model = {1: Client(1), 2: Client(2), 3: _FarClient(3)}, tiny_model()
        for rnd in range(1, 6):
            new, _ = train_round(strategy, clients, rnd, model)
            t = strategy.traffic[rnd]
            if rnd > 1 and clips:
                assert not t.rejected and t.update_norm[3] == pytest.approx(t.update_norm_bound, rel=0.02)
                assert max(t.update_norm[1], t.update_norm[2]) < t.update_norm_bound * 0.9  # (not clipped)
            elif rnd > 1:
                assert list(t.rejected) == [3] and "this round's bound" in t.rejected[3], t.rejected
            model = new if new is not None else model


def test_a_bound_set_by_the_user_holds_where_it_is_smaller() -> None:
    model = tiny_model()
    for user, picked in ((0.5, "max-update-norm"), (1e6, "max-update-norm-factor")):
        strategy = make_strategy(**{"max-update-norm": user, "max-update-norm-factor": FACTOR})
        _, log = train_round(strategy, {1: Client(1)}, 1, model)
        expected = user if picked == "max-update-norm" else FACTOR * not_finite_and_norm(model)[1]
        assert _bound_of(log.downlinks[1]) == pytest.approx(expected)
        assert strategy._bound_why.startswith(picked)
        assert f"max-update-norm {user:g} and 4 x the last round's median" in strategy.config.describe()
    assert "update norms" not in make_strategy().config.describe()


def test_the_median_survives_a_checkpoint_and_a_bad_one_is_refused() -> None:
    strategy = make_strategy(**{"max-update-norm-factor": FACTOR})
    clients, model = {n: Client(n) for n in (1, 2, 3)}, tiny_model()
    new, _ = train_round(strategy, clients, 1, model)
    assert new is not None
    state = strategy.state_dict()
    median = sorted(strategy.traffic[1].update_norm.values())[1]
    assert state["norm-ref"] == [1, median]
    again = make_strategy(**{"max-update-norm-factor": FACTOR})
    again.load_state_dict(state)
    msgs = list(again.configure_train(2, record_from_tensors(new), ConfigRecord({}), FixedGrid([1])))
    assert _bound_of(msgs[0].content.config_records[protocol.DOWNLINK]) == pytest.approx(FACTOR * median)
    for bad in ([1, float("nan")], [1, -1.0], "x", [1]):
        with pytest.raises(PayloadError, match="norm-ref"):
            make_strategy(**{"max-update-norm-factor": FACTOR}).load_state_dict({**state, "norm-ref": bad})
    older = {k: v for k, v in state.items() if k != "norm-ref"}  # (a checkpoint from before the key)
    make_strategy().load_state_dict(older)


@pytest.mark.parametrize("factor", [1.0, 1.99, -1.0, 1e7, float("inf"), float("nan")])
def test_a_factor_that_would_ratchet_or_is_not_a_number_is_refused_naming_the_key(factor: float) -> None:
    with pytest.raises(ValidationError, match="max-update-norm-factor"):
        CompressionConfig.model_validate({"max-update-norm-factor": factor})


def test_a_model_of_zeros_gets_no_bound_before_its_first_update() -> None:
    """The model's norm is 0: no round-1 bound (every update would be clipped to nothing)."""
    zeros = {k: torch.zeros_like(v) for k, v in tiny_model().items()}
    strategy = make_strategy(**{"max-update-norm-factor": FACTOR})
    new, log = train_round(strategy, {1: Client(1), 2: Client(2)}, 1, zeros)
    assert _bound_of(log.downlinks[1]) == 0.0 and strategy.traffic[1].accepted == 2 and new is not None
    _, log = train_round(strategy, {1: Client(1), 2: Client(2)}, 2, new)
    assert _bound_of(log.downlinks[1]) > 0


@pytest.mark.parametrize("uplink", ["sbc", "gradiveq"])
def test_round_one_stops_a_client_just_under_the_models_bound(uplink: str) -> None:
    """The bound the first downlink carries is the factor times the model's norm, far over an
    honest update (85x in a red-team audit): a client sending just under it, claiming 1e9
    examples, replaced the model with noise. The round's own median rejects it. GradiVeQ's first
    rounds are dense updates (its PCA samples), read as such: it kept the model's bound before."""
    model = tiny_model()
    sent = FACTOR * not_finite_and_norm(model)[1]
    strategy = make_strategy(**{"max-update-norm-factor": FACTOR, "uplink-codec": uplink})
    clients = {n: Client(n) for n in range(1, 6)}
    numel = n_params(model)

    def tamper(node: int, reply: Message) -> Message:
        if node != 5:
            return reply
        reply = _huge_payload(reply, magnitude=0.9 * sent / math.sqrt(numel))  # (norm 0.45-0.9 x sent)
        metrics = next(iter(reply.content.metric_records))
        reply.content[metrics]["num-examples"] = 10**9
        return reply

    new, _ = train_round(strategy, clients, 1, model, tamper=tamper)
    t = strategy.traffic[1]
    assert list(t.rejected) == [5] and "this round's updates" in t.rejected[5], t.rejected
    assert new is not None and not_finite_and_norm({k: new[k] - model[k] for k in model})[1] < 1.0


def test_one_round_of_a_tiny_median_does_not_collapse_the_bound() -> None:
    """Round 2 aggregates two updates, one of them a hostile one of about 1e-20: their lower
    median is that. The reference falls at most the factor a round, so round 3's bound is the
    factor times a quarter of round 1's median, not about 4e-20 (which froze the model for 30-70
    rounds: every honest client clipped to it, the bound rising 4x a round)."""
    strategy = make_strategy(**{"max-update-norm-factor": FACTOR})
    clients, model = {n: Client(n) for n in (1, 2, 3, 4)}, tiny_model()
    model, _ = train_round(strategy, clients, 1, model)
    assert model is not None
    first = strategy._norm_ref
    assert first is not None and first[0] == 1
    tiny = lambda n, r: _huge_payload(r, magnitude=1e-20) if n == 4 else r  # noqa: E731
    model, _ = train_round(strategy, clients, 2, model, nodes=[1, 4], tamper=tiny)
    assert model is not None and strategy.traffic[2].accepted == 2
    _, log = train_round(strategy, clients, 3, model)
    assert _bound_of(log.downlinks[1]) == pytest.approx(first[1], rel=1e-12)  # 4 x (median / 4)


def test_a_round_that_aggregates_nothing_loosens_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every update of round 2 is over the bound (clients that ignore it, training 1000x as far):
    none is aggregated, and round 3's bound is the factor larger (a bound no client could meet
    would otherwise hold until max-empty-rounds ends the run)."""
    strategy = make_strategy(**{"max-update-norm-factor": FACTOR, "max-empty-rounds": 9})
    clients, model = {n: Client(n) for n in (1, 2, 3)}, tiny_model()
    model, _ = train_round(strategy, clients, 1, model)
    assert model is not None
    _, log = train_round(strategy, clients, 2, model, tamper=lambda n, r: _huge_payload(r, magnitude=1e3))
    second = _bound_of(log.downlinks[1])
    assert strategy.traffic[2].accepted == 0
    _, log = train_round(strategy, clients, 3, model)
    assert _bound_of(log.downlinks[1]) == pytest.approx(FACTOR * second, rel=1e-12)


class _ScaledClient(Client):
    """A client whose training moves the model ``k`` times as far as the others'."""

    k = 1.0

    def replied(self, received: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: received[key] + self.k * (trained[key] - received[key]) for key in received}


@pytest.mark.parametrize(("k", "claimed", "accepted"), [(30, None, False), (30, 100, True), (60, 10**6, False)])
def test_a_client_that_trained_more_local_iterations_has_more_room(
    k: float, claimed: int | None, accepted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An update's norm grows with the local steps: the bandwidth policy gave a client on a fast
    link 100 iterations where the config said 10, and at factor 4 the server rejected its honest
    update (a real simulation, tests/test_flower_bandwidth.py). Its bound is now 100 / 10 times
    larger (4 x 10 x the median: room for 30x, not for 60x); a claim past local-iters-max (100)
    counts as 100."""
    monkeypatch.setattr(mod_module, "_max_update_norm", lambda dl: None)  # (the server's check alone)
    assert protocol.work_scale(100, 10, 100) == 10 and protocol.work_scale(10**6, 10, 100) == 10
    assert protocol.work_scale(5, 10, 100) == 1 and protocol.work_scale(None, 10, 100) == 1
    strategy = make_strategy(**{"max-update-norm-factor": FACTOR, "uplink-codec": "dense-fp32"})
    far = _ScaledClient(3)
    far.k = k
    clients, model = {1: Client(1), 2: Client(2), 3: far}, tiny_model()
    model, _ = train_round(strategy, clients, 1, model, nodes=[1, 2])
    assert model is not None

    def claim(node: int, reply: Message) -> Message:
        if node == 3 and claimed is not None:
            up = reply.content.config_records[protocol.UPLINK]
            reply.content[protocol.UPLINK] = with_fields(up, local_iters=claimed)
        return reply

    train_round(strategy, clients, 2, model, tamper=claim)
    t = strategy.traffic[2]
    assert (3 not in t.rejected) is accepted, (t.rejected, t.update_norm, strategy._bound)
    if not accepted:
        assert "this round's bound" in t.rejected[3]
    if claimed:
        assert t.local_iters[3] == claimed
