"""The lattice replica (downlink codec ``lattice``): exact merged catch-ups, the snap of the seeded
initial model, grid mismatches, and the bounded log, driven through the real wrapper and mod."""

from __future__ import annotations

import math

import pytest
import torch

from fedcomp.codecs import Lattice, get_codec
from fedcomp.errors import PayloadError
from fedcomp.flower import protocol
from fedcomp.flower.mod import make_compression_mod
from fedcomp.flower.records import digest, tensors_from_record
from fedcomp.flower.replica import FINE_BITS, ServerReplica, apply_delta, apply_lattice, grid_exponents
from fedcomp.methods.update import specs_of
from fedcomp.wire.serde import update_from_bytes
from tests.flower.helpers import (  # noqa: F401  (server_identity: autouse fixture)
    Client,
    make_strategy,
    mode_of,
    payloads_of,
    server_identity,
    tiny_model,
    train_round,
)

MODEL = tiny_model()
LATTICE = {"downlink-codec": "lattice", "lattice-step": 0.5}


class SeededClient(Client):
    """A client whose mod builds the run's initial model itself."""

    def __init__(self, node: int) -> None:
        super().__init__(node)
        own = {k: v.clone() for k, v in MODEL.items()}
        self.mod = make_compression_mod(initial_model=lambda ctx: own)

    def handle(self, msg):  # type: ignore[no-untyped-def]
        return self.mod(msg, self.ctx, self.app)


def _moves(n: int, seed: int = 0, scale: float = 0.01) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    model, out = {k: v.clone() for k, v in MODEL.items()}, []
    for _ in range(n):
        model = {k: v + torch.randn(v.shape, generator=g) * scale for k, v in model.items()}
        out.append(model)
    return out


def _clone(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in t.items()}


def test_a_merged_payload_equals_the_chain_bit_for_bit() -> None:
    codec = get_codec({"id": "lattice", "step": 0.5})
    replica = ServerReplica(MODEL, max_log=100, min_numel=0)
    chain = [replica.advance(m, codec) for m in _moves(6)]
    assert replica.grid is not None
    specs = specs_of(MODEL)
    for start in (0, 2, 4):
        held = _clone(MODEL)
        for v in range(start):  # a client that took part until version `start`
            apply_lattice(held, chain[v], specs, replica.grid if v else None, v)
        assert digest(held) == replica.digest_of(start)
        by_chain = _clone(held)
        for v in range(start, 6):
            apply_lattice(by_chain, chain[v], specs, replica.grid, v)
        dl = replica.downlink_for(start, replica.digest_of(start))
        assert dl.mode == "chain" and len(dl.payloads) == 1
        merged = _clone(held)
        apply_lattice(merged, dl.payloads[0], specs, replica.grid if start else None, start)
        for k in MODEL:
            assert torch.equal(merged[k], by_chain[k]) and torch.equal(merged[k], replica.tensors[k]), k
        assert digest(merged) == replica.digest == dl.digest
        if start <= 2:  # the net change of several rounds costs less than their chain
            assert dl.nbytes < sum(len(b) for b in chain[start:])


def test_clients_at_one_old_version_share_one_merge_until_the_replica_advances() -> None:
    codec = get_codec({"id": "lattice", "step": 0.5})
    replica = ServerReplica(MODEL, max_log=100, min_numel=0)
    moves = _moves(5)
    for m in moves[:4]:
        replica.advance(m, codec)
    first = replica.downlink_for(1, replica.digest_of(1)).payloads[0]
    assert replica.downlink_for(1, replica.digest_of(1)).payloads[0] is first  # merged once, not per client
    assert replica.downlink_for(2, replica.digest_of(2)).payloads[0] != first  # another start, its own merge
    replica.advance(moves[4], codec)
    after = replica.downlink_for(1, replica.digest_of(1))
    held = _clone(MODEL)
    for v in range(1):
        apply_lattice(held, replica._log[v][1], specs_of(MODEL), None, v)
    apply_lattice(held, after.payloads[0], specs_of(MODEL), replica.grid, 1)
    assert after.payloads[0] != first and digest(held) == replica.digest  # merged anew, to the new model


def test_the_replica_is_the_grid_point_of_the_model_and_version_0_stays_the_seeded_model() -> None:
    codec = get_codec({"id": "lattice", "step": 0.5})
    replica = ServerReplica(MODEL, max_log=100, min_numel=0)
    v0 = replica.digest
    assert v0 == digest(MODEL)
    moves = _moves(3)
    for m in moves:
        replica.advance(m, codec)
    assert replica.digest_of(0) == v0  # clients holding the unsnapped seeded model stay verifiable
    assert replica.grid is not None
    for k, e in replica.grid.items():
        h = math.ldexp(1.0, e)
        # R = h * round(W / h): the error is at most h / 2 per entry and never accumulates
        assert torch.equal(replica.tensors[k], torch.round(moves[-1][k] / h) * h), k
        # the grid is set by the first movement: floor(log2(0.5 * RMS))
        rms = float((moves[0][k].double() - MODEL[k].double()).pow(2).mean().sqrt())
        assert e == math.floor(math.log2(0.5 * rms)), k
    # The seeded model itself is not on the grid: applying the first payload snaps it first.
    off = [k for k, e in replica.grid.items() if not torch.equal(torch.round(MODEL[k] / 2.0**e) * 2.0**e, MODEL[k])]
    assert off


def test_a_payload_on_another_grid_is_a_typed_error() -> None:
    codec = get_codec({"id": "lattice", "step": 0.5})
    replica = ServerReplica(MODEL, max_log=100, min_numel=0)
    data = replica.advance(_moves(1)[0], codec)
    assert replica.grid is not None
    held = _clone(MODEL)
    other = {k: e + 1 for k, e in replica.grid.items()}
    with pytest.raises(PayloadError, match="grid"):
        apply_lattice(held, data, specs_of(MODEL), other, 0)
    for k in MODEL:
        assert torch.equal(held[k], MODEL[k])  # nothing applied
    with pytest.raises(PayloadError, match="version"):
        apply_lattice(held, data, specs_of(MODEL), None, 1)
    # A 3LC client cannot add a lattice delta by mistake either.
    with pytest.raises(PayloadError):
        apply_delta(held, data, specs_of(MODEL), get_codec({"id": "3lc", "s": 1.0, "zero_run": True}), 0)


def test_the_log_stays_within_one_dense_model_and_older_clients_get_the_full_replica() -> None:
    codec = get_codec({"id": "lattice", "step": 0.5})
    replica = ServerReplica(MODEL, max_log=10_000, min_numel=0)
    dense = 4 * sum(t.numel() for t in MODEL.values())
    for m in _moves(120, scale=0.05):
        replica.advance(m, codec)
        assert sum(len(b) for _, b in replica._log) <= dense
    held = [v for v in range(replica.version + 1) if replica.digest_of(v) is not None]
    assert 2 <= replica.version - held[0] < 120  # capped by bytes, not by the count
    assert replica.downlink_for(held[0] - 1, "any").mode == "full"
    oldest = replica.downlink_for(held[0], replica.digest_of(held[0]))
    assert oldest.nbytes <= dense


def test_with_delta_log_models_4_the_log_holds_four_models_and_older_clients_still_get_a_merge() -> None:
    """The soak audit's case: with the log capped at one model, clients away about 40 rounds got
    the full model where a merge several times smaller would do. With ``log_models = 4`` a client
    older than one model's worth of deltas gets one merged payload, smaller than the model."""
    codec = get_codec({"id": "lattice", "step": 0.5})
    dense = 4 * sum(t.numel() for t in MODEL.values())
    one, four = (ServerReplica(MODEL, max_log=10_000, min_numel=0, log_models=m) for m in (1.0, 4.0))
    for m in _moves(200, scale=0.05):
        one.advance(m, codec)
        four.advance(m, codec)
        assert sum(len(b) for _, b in four._log) <= 4 * dense
    assert sum(len(b) for _, b in four._log) > 3 * dense  # (filled: the cap binds, not the moves)
    oldest_one = min(v for v in range(one.version + 1) if one.digest_of(v) is not None)
    oldest_four = min(v for v in range(four.version + 1) if four.digest_of(v) is not None)
    assert oldest_four < oldest_one - 20
    away = oldest_one - 5  # older than the one-model log reaches
    assert one.downlink_for(away, "any").mode == "full"
    dl = four.downlink_for(away, four.digest_of(away))
    assert dl.mode == "chain" and len(dl.payloads) == 1 and dl.nbytes < dense / 2
    # 3LC deltas keep the one-model cap whatever log_models says: a longer chain is never sent.
    tlc = ServerReplica(MODEL, max_log=10_000, min_numel=0, log_models=4.0)
    for m in _moves(120, scale=0.05):
        tlc.advance(m, get_codec({"id": "3lc"}))
        assert sum(len(b) for _, b in tlc._log) <= dense


def test_sampled_run_replicas_match_and_catch_ups_are_single_payloads() -> None:
    strategy = make_strategy(**LATTICE, **{"seeded-initial-model": True})
    clients = {n: SeededClient(n) for n in range(1, 7)}
    model = _clone(MODEL)
    schedule = [[1, 2], [3, 4], [1, 5], [2, 6], [3, 1], [4, 5], [6, 2], [1, 3]]
    modes: list[str] = []
    for rnd, nodes in enumerate(schedule, start=1):
        new, log = train_round(strategy, clients, rnd, model, nodes=nodes)
        assert new is not None and strategy.traffic[rnd].accepted == len(nodes), rnd
        for n, rec in log.downlinks.items():
            modes.append(mode_of(rec))
            assert mode_of(rec) in ("none", "chain"), (rnd, n, mode_of(rec))
            assert len(payloads_of(rec)) <= 1
            up = log.uplinks[n]
            assert up["replica-version"] == strategy.replica.version  # type: ignore[union-attr]
            assert up["replica-digest"] == strategy.replica.digest  # type: ignore[union-attr]
            held = clients[n].ctx.state.config_records.get(protocol.STATE_LATTICE)
            assert (dict(held) if held is not None else None) == strategy.replica.grid  # type: ignore[union-attr]
        model = new
    assert modes.count("chain") >= 10
    # Every client that took part holds the server's replica of the version it reported.
    for c in clients.values():
        meta = protocol.ReplicaMeta.from_record(c.ctx.state.config_records[protocol.STATE_META])
        assert strategy.replica.digest_of(meta.version) in (meta.digest, None)  # type: ignore[union-attr]


def test_a_client_on_another_grid_resyncs_then_catches_up_from_its_seeded_model() -> None:
    strategy = make_strategy(**LATTICE, **{"seeded-initial-model": True})
    clients = {n: SeededClient(n) for n in (1, 2)}
    new, _ = train_round(strategy, clients, 1, MODEL, nodes=[1, 2])
    assert new is not None
    new2, _ = train_round(strategy, clients, 2, new, nodes=[1, 2])
    assert new2 is not None
    grid = dict(clients[2].ctx.state.config_records[protocol.STATE_LATTICE])
    clients[2].ctx.state[protocol.STATE_LATTICE] = protocol.lattice_grid_record({k: e - 1 for k, e in grid.items()})
    new3, log = train_round(strategy, clients, 3, new2, nodes=[1, 2])
    reply = log.replies[2]
    assert reply.has_error() and reply.error.code == int(protocol.ErrorCode.RESYNC)
    assert "grid" in reply.error.reason
    assert protocol.STATE_LATTICE not in clients[2].ctx.state.config_records  # forgotten with the replica
    assert new3 is not None
    # It rebuilds version 0 itself: one merged payload from version 0, no full model.
    _, log = train_round(strategy, clients, 4, new3, nodes=[1, 2])
    assert mode_of(log.downlinks[2]) == "chain"
    (payload,) = payloads_of(log.downlinks[2])
    assert update_from_bytes(payload).base_model_version == 0
    assert log.uplinks[2]["replica-digest"] == strategy.replica.digest  # type: ignore[union-attr]
    held = clients[2].ctx.state.config_records[protocol.STATE_LATTICE]
    assert dict(held) == strategy.replica.grid  # type: ignore[union-attr]


def test_a_merged_payload_decodes_as_lattice_only() -> None:
    codec = get_codec({"id": "lattice", "step": 0.5})
    replica = ServerReplica(MODEL, max_log=100, min_numel=0)
    for m in _moves(3):
        replica.advance(m, codec)
    dl = replica.downlink_for(0, replica.digest_of(0))
    update = update_from_bytes(dl.payloads[0], expected=specs_of(MODEL))
    assert update.base_model_version == 0
    assert {t.codec_id for t in update.tensors} == {Lattice.codec_id}


@pytest.mark.parametrize("e", [-12, -4, 0, 3])
def test_cpu_merge_equals_the_device_generic_lines(e: int) -> None:
    # apply_lattice's NumPy merge on CPU against the torch expression every other device runs:
    # a replica off the grid (the first delta snaps it), on it, half steps, and the |K| bound.
    from fedcomp.flower.replica import _merge_cpu

    gen = torch.Generator().manual_seed(e + 100)
    h = math.ldexp(1.0, e)
    current = torch.randn(3001, generator=gen) * 40 * h
    current[::3] = torch.round(current[::3] / h) * h + h / 2  # exact half steps: ties to even
    d = torch.randint(-5, 6, (3001,), generator=gen).to(torch.float32) * h
    want = (torch.round(current / h) + d / h) * h
    before = current.clone()
    got = _merge_cpu(current, d.clone(), h, "w", e)
    assert torch.equal(got, want)
    assert torch.equal(current, before)  # the replica's old tensor is left as it was
    far = current.clone()
    far[7] = (2.0**24 + 10) * h  # past the bound whatever d adds there (|d / h| <= 5)
    with pytest.raises(PayloadError, match="leaves the grid"):
        _merge_cpu(far, d.clone(), h, "w", e)
    nan = current.clone()
    nan[5] = math.nan
    with pytest.raises(PayloadError, match="leaves the grid"):
        _merge_cpu(nan, d.clone(), h, "w", e)


def test_the_device_merge_of_many_tensors_equals_the_cpu_one_and_checks_them_all_first() -> None:
    # apply_lattice's merge on other devices (_merge_torch: every tensor merged, one wait for the
    # grid check) against the NumPy merge, tensor by tensor; run here on CPU tensors.
    from fedcomp.flower.replica import _merge_cpu, _merge_torch

    gen = torch.Generator().manual_seed(9)
    items = {}
    for i, e in enumerate([-12, -4, 0, 3, -7]):
        h = math.ldexp(1.0, e)
        current = torch.randn(500 + i, generator=gen) * 40 * h
        d = torch.randint(-5, 6, (500 + i,), generator=gen).to(torch.float32) * h
        items[f"t{i}"] = (current, d, e)
    items["empty"] = (torch.zeros(0), torch.zeros(0), 1)
    got = _merge_torch(items)
    assert list(got) == list(items)
    for k, (current, d, e) in items.items():
        assert torch.equal(got[k], _merge_cpu(current, d.clone(), math.ldexp(1.0, e), k, e)), k
    for bad in (2.0**24 + 10, math.nan):
        far = dict(items)
        current, d, e = items["t3"]
        off = current.clone()
        off[7] = bad * math.ldexp(1.0, e)
        far["t3"] = (off, d, e)
        with pytest.raises(PayloadError, match=r"^tensor 't3': the replica leaves the grid 2\*\*3 "):
            _merge_torch(far)


@pytest.mark.parametrize("e", [-12, -4, 2])
def test_cpu_lattice_step_equals_the_device_generic_lines(e: int) -> None:
    from fedcomp.errors import ConfigError
    from fedcomp.flower.replica import _lattice_step_cpu

    gen = torch.Generator().manual_seed(e + 7)
    h = math.ldexp(1.0, e)
    w = torch.randn(20, 151, generator=gen) * 300 * h
    w.view(-1)[::4] = (torch.round(w.view(-1)[::4] / h) + 0.5) * h  # exact half steps: ties to even
    r = torch.round(torch.randn(20, 151, generator=gen) * 300) * h
    want = (torch.round(w / h) - torch.round(r / h)) * h
    got, _ = _lattice_step_cpu(w, r, h, "w", e)
    assert got.shape == w.shape and torch.equal(got, want)
    for bad in (2.0**24 * h, math.inf, math.nan):
        off = w.clone()
        off[3, 4] = bad
        with pytest.raises(ConfigError, match="does not fit its grid"):
            _lattice_step_cpu(off, r, h, "w", e)
        # a running statistic's grid is its own, not lattice-step's: the message says what helps
        with pytest.raises(ConfigError, match=r"running statistic 'bn.running_var' grew past its grid .*\(3lc"):
            _lattice_step_cpu(off, r, h, "bn.running_var", e)


def test_the_server_merges_its_own_delta_to_the_bits_a_client_decodes() -> None:
    """The replica merges the delta it encoded without parsing its own payload: after every round
    its tensors are, bit for bit (the sign of zero included), what apply_lattice of that round's
    bytes gives from the previous replica, as a client computes it. Entries that round to -0.0 on
    the grid give deltas of -0.0, which are not sent and decode as +0.0."""
    from fedcomp.flower.replica import _lattice_step_cpu

    gen = torch.Generator().manual_seed(5)
    start = {k: v.clone() for k, v in MODEL.items()}
    first = next(iter(start))
    start[first].view(-1)[::5] = -1e-30  # rint(-1e-30 / h) = -0.0: a seeded model of negative zeros
    codec = get_codec({"id": "lattice", "step": 0.5})
    replica = ServerReplica(start, max_log=100, min_numel=0)
    negative_zero_deltas = 0
    for rnd in range(4):
        target = {k: v + torch.randn(v.shape, generator=gen) * 0.01 for k, v in start.items()}
        target[first].view(-1)[::5] = -1e-30 if rnd % 2 else 1e-30  # these entries move by +-0.0
        before, version = _clone(replica.tensors), replica.version
        data = replica.advance(target, codec)
        assert replica.grid is not None
        e = replica.grid[first]
        d, _ = _lattice_step_cpu(target[first], before[first], math.ldexp(1.0, e), first, e)
        negative_zero_deltas += int(((d == 0) & torch.signbit(d)).sum())
        apply_lattice(before, data, specs_of(start), replica.grid if version else None, version)
        for k, got in replica.tensors.items():
            assert torch.equal(got.view(torch.int32), before[k].view(torch.int32)), (rnd, k)
    assert negative_zero_deltas  # the sign of zero was at stake (so the comparison above saw it)


# --- the grid each tensor gets (grid_exponents) ---------------------------------------------------


def _rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


def _normal(n: int, scale: float, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


def test_a_first_movement_large_against_the_weights_is_bounded_by_the_weights() -> None:
    # Adam's first round on an LSTM: weights of RMS 0.04 each move by about 0.025.
    base = {"lstm": _normal(4000, 0.04, 1), "conv": _normal(4000, 0.1, 2)}
    target = {"lstm": base["lstm"] + _normal(4000, 0.025, 3), "conv": base["conv"] + _normal(4000, 0.0005, 4)}
    grid = grid_exponents(target, base, step=12.0, weight_step=2.0)
    by_movement = grid_exponents(target, base, step=12.0, weight_step=1024.0)
    assert by_movement["lstm"] == math.floor(math.log2(12.0 * _rms(target["lstm"] - base["lstm"])))  # 2**-2
    assert grid["lstm"] == math.floor(math.log2(2.0 * _rms(target["lstm"]))) < by_movement["lstm"]
    # A tensor that moved little against its values keeps the grid of its movement (LeNet's case).
    assert grid["conv"] == by_movement["conv"] == math.floor(math.log2(12.0 * _rms(target["conv"] - base["conv"])))


def test_a_zero_initialised_tensor_and_a_frozen_one_take_their_own_bound() -> None:
    base = {"w": _normal(4000, 0.05, 5), "bias": torch.zeros(300), "frozen": _normal(300, 0.001, 6)}
    target = {"w": base["w"] + _normal(4000, 0.02, 7), "bias": _normal(300, 0.01, 8), "frozen": base["frozen"]}
    grid = grid_exponents(target, base, step=12.0, weight_step=2.0)
    # The bias's first movement is its values: the bound, 6x finer than 12x its movement.
    assert grid["bias"] == math.floor(math.log2(2.0 * _rms(target["bias"])))
    assert grid["bias"] < grid_exponents(target, base, step=12.0, weight_step=1024.0)["bias"]
    # The frozen tensor's fallback (the smallest exponent that moved) is bounded by its own values.
    assert grid["frozen"] == math.floor(math.log2(2.0 * _rms(target["frozen"]))) < grid["w"]


def test_the_bound_leaves_the_integer_rule_and_the_range_floor_in_force() -> None:
    # A counter keeps a grid that holds every integer; a tensor with a value of 1000 moving very little
    # keeps |K| < 2**22 (the floor raises the movement's exponent; the bound is far above both).
    base = {"count": torch.tensor([3000.0]), "big": _normal(5000, 1.0, 9)}
    base["big"][0] = 1000.0
    target = {"count": torch.tensor([4000.0]), "big": base["big"] + _normal(5000, 1e-6, 10)}
    grid = grid_exponents(target, base, step=12.0, weight_step=2.0)
    assert grid["count"] == 0
    floor = math.frexp(float(target["big"].abs().max()))[1] - 22
    assert grid["big"] == floor > math.floor(math.log2(12.0 * _rms(target["big"] - base["big"])))


def test_the_run_config_bounds_the_grid_of_the_strategy_and_its_clients() -> None:
    # Through the real wrapper and mod: lattice-weight-step reaches the grid the clients adopt.
    grids = {}
    for weight_step in (0.25, 1024.0):
        strategy = make_strategy(**{**LATTICE, "lattice-step": 12.0, "lattice-weight-step": weight_step})
        clients = {n: Client(n) for n in (1, 2)}
        new, _ = train_round(strategy, clients, 1, MODEL)
        assert new is not None
        train_round(strategy, clients, 2, new)
        assert strategy.replica is not None and strategy.replica.grid is not None
        assert strategy.replica.grid == grid_exponents(new, MODEL, 12.0, weight_step)
        for c in clients.values():
            assert dict(c.ctx.state.config_records[protocol.STATE_LATTICE]) == strategy.replica.grid
        grids[weight_step] = strategy.replica.grid
    assert all(grids[0.25][k] < grids[1024.0][k] for k in ("w1", "w2"))


def test_running_statistics_take_a_fine_grid() -> None:
    """A running statistic (by name, any size) gets a grid that puts its largest value, before or
    after, under ``2**FINE_BITS`` steps; an integer counter keeps the integer rule; the rest keep
    the grid of their movement. On its movement's grid a variance near 0.1 is rounded to a
    multiple of 0.5 (a negative variance in the audit that found it)."""
    var = torch.rand(2048, generator=torch.Generator().manual_seed(11)) * 0.2 + 0.01
    base = {
        "layer.bn.running_var": torch.ones(2048),
        "layer.bn.running_mean": torch.zeros(2048),
        "bn/moving_variance:0": torch.ones(64),
        "bias": torch.zeros(300),
        "w": _normal(4000, 0.05, 12),
        "layer.bn.num_batches_tracked": torch.tensor(0.0),
    }
    target = {
        "layer.bn.running_var": var,
        "layer.bn.running_mean": _normal(2048, 0.3, 13),
        "bn/moving_variance:0": var[:64],
        "bias": _normal(300, 0.01, 14),
        "w": base["w"] + _normal(4000, 0.001, 15),
        "layer.bn.num_batches_tracked": torch.tensor(50.0),
    }
    grid = grid_exponents(target, base, step=12.0, weight_step=2.0)
    for name in ("layer.bn.running_var", "layer.bn.running_mean", "bn/moving_variance:0"):
        biggest = max(float(target[name].abs().max()), float(base[name].abs().max()))
        assert grid[name] == math.frexp(biggest)[1] - FINE_BITS, name
    assert grid["bias"] == math.floor(math.log2(2.0 * _rms(target["bias"])))  # not a statistic
    assert grid["w"] == math.floor(math.log2(12.0 * _rms(target["w"] - base["w"])))
    assert grid["layer.bn.num_batches_tracked"] == 0
    h = math.ldexp(1.0, grid["layer.bn.running_var"])
    replica = torch.round(var / h) * h
    assert float((replica - var).abs().max()) <= 2.0**-FINE_BITS and bool((replica > 0).all())  # (largest: 1)
    coarse = math.ldexp(1.0, math.floor(math.log2(2.0 * _rms(var))))  # the bound alone: 2**-2
    assert bool((torch.round(var / coarse) * coarse == 0).any())


def test_a_client_whose_reply_timed_out_takes_its_last_payload_back_and_applies_the_merge() -> None:
    """Node 2's round-2 reply never reaches the server (a timeout): the server still counts it at
    the version before round 2's payload, which the client applied. Round 3's merge from that
    version is applied after the client takes its last payload back, exactly (the digest checks
    it): no resync, no round lost (before: "delta is against version 1, replica is at 2"). Missed
    replies in a row work too: the payload the client keeps always starts at the version the
    server counts."""
    strategy = make_strategy(**LATTICE)
    clients = {1: Client(1), 2: Client(2)}
    model = MODEL
    for rnd in range(1, 6):
        new, log = train_round(strategy, clients, rnd, model, drop={2} if rnd in (2, 4) else ())
        assert new is not None
        if rnd in (3, 5):
            assert mode_of(log.downlinks[2]) == "chain" and not log.replies[2].has_error(), rnd
            assert strategy.traffic[rnd].accepted == 2 and not strategy.traffic[rnd].failed
        model = new
    for rnd in (6, 7, 8):  # two missed replies in a row, then one that arrives
        new, log = train_round(strategy, clients, rnd, model, drop={2} if rnd < 8 else ())
        assert new is not None and not log.replies[2].has_error(), rnd
        model = new
    assert mode_of(log.downlinks[2]) == "chain" and strategy.traffic[8].accepted == 2
    assert strategy.replica is not None
    held = tensors_from_record(clients[2].ctx.state.array_records[protocol.STATE_REPLICA])
    assert all(torch.equal(held[k], strategy.replica.tensors[k]) for k in held)


def test_delta_log_models_reaches_the_replica_and_a_resumed_one() -> None:
    strategy = make_strategy(**LATTICE, **{"delta-log-models": 2.5})
    train_round(strategy, {1: Client(1)}, 1, MODEL)
    assert strategy.replica is not None and strategy.replica.log_models == 2.5
    resumed = make_strategy(**LATTICE, **{"delta-log-models": 8})
    resumed.load_state_dict(strategy.state_dict())
    assert resumed.replica is not None and resumed.replica.log_models == 8  # (config, not state)
    assert make_strategy(**LATTICE).config.delta_log_models == 4.0
