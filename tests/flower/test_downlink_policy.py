"""The "auto" downlink (fedcomp.flower.downlink_policy): each round the smallest candidate whose
replica lag meets ``replica-lag-max``, else the least lag; trials never touch the replica."""

from __future__ import annotations

import copy

import pytest
import torch

from fedcomp.codecs import get_codec
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.flower.downlink_policy import Trial, advance_by_policy, chain_decoders, choose, distance, try_candidate
from fedcomp.flower.replica import ServerReplica
from fedcomp.flower.settings import CompressionConfig
from fedcomp.methods.downlinks import DenseFP32Downlink, ThreeLCDownlink
from fedcomp.methods.registry import get_downlink
from fedcomp.methods.sparse_downlinks import SparseFP16Downlink, SparseFP32Downlink, parse_candidates
from fedcomp.methods.update import decode_update
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

N = 20_000


def _replica_and_targets(density: float, seed: int = 0) -> tuple[ServerReplica, dict, dict]:
    """A replica synced exactly to W_prev, and a target W = W_prev + a delta that is nonzero on a
    ``density`` fraction of entries and spiky (a few large entries, many small: what the
    aggregate of sparse uplinks looks like)."""
    g = torch.Generator().manual_seed(seed)
    prev = {"w": torch.randn(N, generator=g) * 0.1, "b": torch.randn(10, generator=g) * 0.1}
    replica = ServerReplica(prev, max_log=16, min_numel=1000)
    delta = torch.zeros(N)
    pos = torch.randperm(N, generator=g)[: int(density * N)]
    delta[pos] = torch.randn(pos.numel(), generator=g) * 0.001
    delta[pos[:5]] *= 40.0  # a few large entries from single clients
    target = {"w": prev["w"] + delta, "b": prev["b"] + 0.001}
    return replica, prev, target


def _config(**keys: object) -> CompressionConfig:
    return CompressionConfig.from_run_config({"downlink-codec": "auto", **keys})


def _state(replica: ServerReplica) -> tuple:
    return (
        replica.version,
        replica.digest,
        {k: v.clone() for k, v in replica.tensors.items()},
        list(replica._log),
        dict(replica._digests),
    )


def _same_state(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == b[1] and all(torch.equal(a[2][k], b[2][k]) for k in a[2]) and a[3:] == b[3:]


CANDIDATES = [(ThreeLCDownlink, 1), (ThreeLCDownlink, 2), (SparseFP16Downlink, 1), (SparseFP32Downlink, 1),
              (DenseFP32Downlink, 1)]  # fmt: skip


def _trials(replica, prev, target, config) -> list[Trial]:
    moved = distance(target, prev)
    return [try_candidate(replica, target, m, n, moved, config, 2) for m, n in CANDIDATES]


def test_trials_measure_what_each_candidate_would_send_without_touching_the_replica() -> None:
    replica, prev, target = _replica_and_targets(0.01)
    before = _state(replica)
    trials = _trials(replica, prev, target, _config())
    assert _same_state(before, _state(replica))
    by = {t.name: t for t in trials}
    # each trial's bytes are what advancing a copy with that codec sends, pass by pass
    for name, codec_cfg, passes in (("3lc", {"id": "3lc", "s": 1.0, "zero_run": True}, 1),
                                    ("sparse-fp32", {"id": "sparse", "values": "float32", "threshold": 0.0}, 1)):  # fmt: skip
        twin = copy.deepcopy(replica)
        sent = sum(len(twin.advance(target, get_codec(codec_cfg))) for _ in range(passes))
        assert by[name].nbytes == sent and by[name].after == distance(target, twin.tensors)
    # the exact sparse downlink leaves nothing behind and costs about the support, not the model
    assert by["sparse-fp32"].lag == 0.0 and by["sparse-fp32"].nbytes < by["dense-fp32"].nbytes / 10
    assert by["3lc*2"].lag < by["3lc"].lag and by["3lc*2"].nbytes > by["3lc"].nbytes


def test_picks_the_smallest_candidate_meeting_the_bound() -> None:
    replica, prev, target = _replica_and_targets(0.01)
    trials = _trials(replica, prev, target, _config())
    lags = {t.name: t.lag for t in trials}
    # a bound every candidate meets: the fewest bytes (3LC here)
    assert choose(trials, 1e9).name == min(trials, key=lambda t: t.nbytes).name == "3lc"
    # a bound only the exact candidates meet: the cheaper of them, the sparse one
    assert lags["3lc*2"] > 1e-6 and lags["sparse-fp16"] > 1e-6
    assert choose(trials, 1e-6).name == "sparse-fp32"
    # a bound between 3LC's two lags: two passes
    mid = (lags["3lc"] + lags["3lc*2"]) / 2
    chosen = choose(trials, mid)
    assert chosen.lag <= mid and all(t.nbytes >= chosen.nbytes for t in trials if t.lag <= mid)


def test_a_dense_difference_goes_dense_when_that_is_smaller() -> None:
    replica, prev, _ = _replica_and_targets(0.0)
    g = torch.Generator().manual_seed(5)
    target = {k: v + torch.randn(v.shape, generator=g) * 0.001 for k, v in prev.items()}
    trials = _trials(replica, prev, target, _config())
    by = {t.name: t for t in trials}
    assert by["sparse-fp32"].nbytes > by["dense-fp32"].nbytes  # positions cost more than they save
    assert choose(trials, 1e-6).name == "dense-fp32"


def test_falls_back_to_the_least_lag_when_nothing_meets_the_bound() -> None:
    replica, prev, target = _replica_and_targets(0.01)
    config = _config()
    moved = distance(target, prev)
    only_3lc = [try_candidate(replica, target, ThreeLCDownlink, n, moved, config, 2) for n in (1, 3, 2)]
    assert all(t.lag > 0 for t in only_3lc)
    assert choose(only_3lc, 0.0).name == "3lc*3" == min(only_3lc, key=lambda t: t.lag).name
    with pytest.raises(ValueError, match="no candidates"):
        choose([], 0.5)


def test_commit_equals_advancing_with_the_chosen_codec_alone() -> None:
    replica, prev, target = _replica_and_targets(0.01)
    twin = copy.deepcopy(replica)
    config = _config(**{"replica-lag-max": 1e-6})
    chosen = advance_by_policy(replica, target, distance(target, prev), config, 2, CANDIDATES)
    assert chosen.name == "sparse-fp32" and chosen.after == 0.0 and chosen.passes == 1
    data = twin.advance(target, get_codec(SparseFP32Downlink.codec_config(config, 2)))
    assert _same_state(_state(replica), _state(twin)) and replica._log[-1][1] == data
    assert all(torch.equal(replica.tensors[k], target[k]) for k in target)  # exact


@pytest.mark.parametrize("lag_max", [1e9, 1e-6, 0.0])
def test_trials_keep_at_most_two_scratch_copies_and_commit_the_chosen_one(
    monkeypatch: pytest.MonkeyPatch, lag_max: float
) -> None:
    """Only the best trial's scratch replica outlives the next trial (each was kept to the end:
    one copy of the model per candidate), and the committed state is the one choose() picks."""
    import gc
    import weakref

    import fedcomp.flower.downlink_policy as policy

    replica, prev, target = _replica_and_targets(0.01)
    twin = copy.deepcopy(replica)
    config = _config(**{"replica-lag-max": lag_max})
    moved = distance(target, prev)
    scratches: list[weakref.ref] = []
    alive: list[int] = []
    real_trial = policy._trial

    def tracked(*args: object, **kwargs: object) -> tuple[Trial, ServerReplica]:
        gc.collect()
        alive.append(sum(r() is not None for r in scratches))  # copies alive as this trial starts
        trial, scratch = real_trial(*args, **kwargs)  # type: ignore[arg-type]
        scratches.append(weakref.ref(scratch))
        return trial, scratch

    monkeypatch.setattr(policy, "_trial", tracked)
    chosen = advance_by_policy(replica, target, moved, config, 2, CANDIDATES)
    assert alive[0] == 0 and max(alive) == 1 and len(alive) == len(CANDIDATES)
    expected = choose([try_candidate(twin, target, m, n, moved, config, 2) for m, n in CANDIDATES], lag_max)
    assert chosen == expected and chosen.name == {1e9: "3lc", 1e-6: "sparse-fp32", 0.0: "sparse-fp32"}[lag_max]
    for _ in range(expected.passes):
        twin.advance(target, get_codec(expected.method.codec_config(config, 2)))
    assert _same_state(_state(replica), _state(twin))
    with pytest.raises(ValueError, match="no candidates"):
        advance_by_policy(replica, target, moved, config, 3, [])


def test_candidates_config() -> None:
    assert parse_candidates("3lc, 3lc*2 ,sparse-fp16") == [(ThreeLCDownlink, 1), (ThreeLCDownlink, 2),
                                                          (SparseFP16Downlink, 1)]  # fmt: skip
    for bad, why in (("3lc*0", "passes"), ("3lc*x", "passes"), ("nope", "unknown"), ("auto", "policy"), ("", "list")):
        with pytest.raises(ConfigError, match=why):
            CompressionConfig.from_run_config({"downlink-codec": "auto", "downlink-candidates": bad})
    config = _config(**{"downlink-candidates": "sparse-fp16,dense-fp32"})
    # before any choice, clients are told the first candidate's codec
    assert get_downlink("auto").codec_config(config, 1) == SparseFP16Downlink.codec_config(config, 1)


def _run(rounds: int, nodes_of: dict[int, list[int]] | None = None, **keys: object):
    """``rounds`` in process with 3 clients (``nodes_of``: the nodes of a round, default all);
    checks that every client that trained trained from exactly the server's replica."""
    strategy = make_strategy(**{"downlink-codec": "auto", "sbc-p": 0.05, **keys})
    clients = {n: Client(n) for n in (1, 2, 3)}
    model = tiny_model()
    chosen, logs = {}, {}
    for rnd in range(1, rounds + 1):
        nodes = (nodes_of or {}).get(rnd)
        new, logs[rnd] = train_round(strategy, clients, rnd, model, nodes=nodes)
        assert new is not None and not strategy.traffic[rnd].rejected
        chosen[rnd] = strategy.downlink_method.method_id
        for n in nodes if nodes is not None else clients:
            if rnd in clients[n].seen:  # else its mod answered with an error instead
                received = clients[n].seen[rnd][0]
                assert all(torch.equal(received[k], strategy.replica.tensors[k]) for k in received), (rnd, n)
        model = new
    return strategy, chosen, logs, clients


def test_auto_through_the_wrapper_and_mod_keeps_replicas_bit_identical() -> None:
    strategy, chosen, logs, clients = _run(6, **{"replica-lag-max": 0.1})
    assert chosen[1] == "auto"  # round 1 sends full replicas: no choice yet
    # the choice changes from round to round (3LC while it keeps the lag under 0.1, then sparse),
    # the lag bound holds in every round, and every client decodes whatever codec it is sent
    assert len({chosen[r] for r in range(2, 7)}) >= 2, chosen
    for rnd in range(2, 7):
        assert strategy.traffic[rnd].replica_lag <= 0.1
        assert all(mode_of(d) == "chain" for d in logs[rnd].downlinks.values())
        assert all(rnd in c.seen for c in clients.values())


def test_auto_with_a_client_away_for_rounds() -> None:
    """A returning client's chain may hold deltas of several codecs: the client decodes every
    one of them (``chain_decoders``), so it trains that round from exactly the server's replica
    (``_run`` checks it bit for bit), with no resync."""
    away = {2: [1, 2], 3: [1, 2], 4: [1, 2]}
    _, chosen, logs, clients = _run(6, away, **{"replica-lag-max": 0.07, "downlink-candidates": "3lc,sparse-fp32"})
    chain = payloads_of(logs[5].downlinks[3])
    codecs = {t.codec_id for p in chain for t in update_from_bytes(p).tensors} - {"dense-fp32"}
    assert mode_of(logs[5].downlinks[3]) == "chain" and codecs == {"3lc", "sparse"}, chosen  # a mixed chain
    reply = logs[5].replies[3]
    assert not reply.has_error(), reply.error.reason
    assert 5 in clients[3].seen and 6 in clients[3].seen
    assert mode_of(logs[6].downlinks[3]) != "full"


def test_chain_decoders_read_a_chain_that_mixes_every_candidate_codec() -> None:
    """The decoders a client needs for a chain of "auto" deltas (the mod uses them): applied in order, they rebuild the server's replica."""
    replica, prev, target = _replica_and_targets(0.01)
    client = {k: v.clone() for k, v in replica.tensors.items()}
    config = _config()
    sent = []
    for rnd, method in enumerate((ThreeLCDownlink, SparseFP16Downlink, SparseFP32Downlink, DenseFP32Downlink), 1):
        target = {k: v + 0.001 * (rnd + 1) for k, v in target.items()}
        sent.append((replica.version, replica.advance(target, get_codec(method.codec_config(config, rnd)))))
    header = get_codec(DenseFP32Downlink.codec_config(config, 5))  # the last round's codec
    for version, data in sent:
        update = update_from_bytes(data, expected=replica.specs)
        assert update.base_model_version == version
        for k, d in decode_update(update, replica.specs, [*chain_decoders(), header]).items():
            client[k] += d
    assert all(torch.equal(client[k], replica.tensors[k]) for k in client)
    with pytest.raises(PayloadError, match="not accepted"):  # the header's codec alone cannot
        decode_update(update_from_bytes(sent[0][1]), replica.specs, [header])


def test_distance_is_the_float64_norm_of_the_differences_over_every_piece() -> None:
    import math

    g = torch.Generator().manual_seed(3)
    # (a tensor over three pieces, a non-contiguous one, a tiny one, an empty one; values whose
    # float32 differences would round: the differences are taken in float64)
    a = {
        "big": torch.randn(3 * (1 << 16) + 17, generator=g) * 1e3,
        "t": torch.randn(40, 30, generator=g).t(),
        "one": torch.tensor([1.0 + 2**-23]),
        "none": torch.zeros(0),
    }
    b = {k: (v * (1 + 1e-7) if k != "one" else torch.tensor([1.0])) for k, v in a.items()}
    want = math.sqrt(
        math.fsum(float(x) ** 2 for k in a for x in a[k].double().numpy().ravel() - b[k].double().numpy().ravel())
    )
    assert distance(a, b) == pytest.approx(want, rel=1e-12)
    assert distance(a, a) == 0.0 and distance({}, {}) == 0.0
    assert distance({"one": a["one"]}, {"one": b["one"]}) == 2**-23  # (float32 arithmetic gives it too; no less)
    at = (1 << 16) + 5  # (in the second piece)
    x = a["big"]
    y = x.clone()
    y[at] = 0.0
    assert distance({"big": x}, {"big": y}) == abs(float(x[at])) > 0


def test_trials_hash_no_scratch_replica_and_the_kept_one_hashes_its_own_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fedcomp.flower.replica as replica_mod
    from fedcomp.flower.records import digest as real_digest

    replica, prev, target = _replica_and_targets(0.01)
    config = _config()
    replica.advance(prev, get_codec(ThreeLCDownlink.codec_config(config, 1)))  # (a version 1, as a round leaves)
    v1, d1 = replica.version, replica.digest
    hashed: list[int] = []

    def counted(tensors: dict) -> str:
        hashed.append(1)
        return real_digest(tensors)

    monkeypatch.setattr(replica_mod, "digest", counted)
    chosen = advance_by_policy(replica, target, distance(target, prev), config, 2, CANDIDATES)
    passes = sum(n for _, n in CANDIDATES)
    assert chosen.passes >= 1 and passes > len(CANDIDATES)  # (some candidates make two passes)
    # only the versions a trial went on from (multi-pass candidates) were hashed, not each last one
    assert len(hashed) == passes - len(CANDIDATES)
    hashed.clear()
    assert replica.digest == real_digest(replica.tensors) and len(hashed) == 1  # hashed when asked for
    assert replica.digest_of(v1) == d1 and len(hashed) == 1  # the older one kept, not hashed again
    before = replica.digest
    replica.advance(target, get_codec(ThreeLCDownlink.codec_config(config, 3)))
    assert replica.digest_of(replica.version - 1) == before
