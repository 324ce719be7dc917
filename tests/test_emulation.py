"""Emulated round time and time to accuracy from recorded bytes (no Flower run)."""

from __future__ import annotations

import pytest

from fedcomp.bench.links import compare
from fedcomp.emulation import emulate_run, time_to_accuracy
from fedcomp.links import LinkProfile


def _results(rounds: list[tuple[float, list[int], list[int]]], **extra_per_round: list[dict]) -> dict:
    """rounds: (accuracy, downlink bytes per client, uplink bytes per client); round 0 first."""
    out = []
    for r, (acc, down, up) in enumerate(rounds):
        ids = [str(i) for i in range(len(down))]
        entry = {"round": r, "accuracy": acc, "clients": {"ids": ids, "downlink_bytes": down, "uplink_bytes": up}}
        for key, values in extra_per_round.items():
            entry[key] = values[r]
        out.append(entry)
    return {"config": {"local-iters": 10, "round-timeout": 30.0}, "rounds": out}


def test_round_time_is_the_slowest_client() -> None:
    res = _results([(0.1, [], []), (0.5, [1_000_000, 1_000_000], [250_000, 500_000])])
    link = LinkProfile(8.0, 16.0, 50)  # 1 MB/s up, 2 MB/s down, 50 ms each way
    (r0, r1) = emulate_run(res, link, seconds_per_iter=0.01)
    assert r0.round_s == 0 and r0.time_s == 0
    # client 1: compute 0.1 + down 0.5 + up 0.5 + latency 0.1 = 1.2 s
    assert r1.slowest == "1" and r1.round_s == pytest.approx(1.2)
    assert r1.compute_s == pytest.approx(0.1) and r1.transfer_s == pytest.approx(1.1)


def test_recorded_links_iterations_and_train_seconds() -> None:
    res = _results(
        [(0.1, [], []), (0.6, [100_000, 100_000], [10_000, 10_000])],
        client_links=[{}, {"0": [0.1, 10.0, 0.0], "1": [100.0, 100.0, 0.0]}],
        client_local_iters=[{}, {"0": 2, "1": 50}],
        client_train_seconds=[{}, {"0": 0.3, "1": 4.0}],
    )
    (_, r1) = emulate_run(res, seconds_per_iter=0.01)
    # client 0: 0.02 + 0.08 + 0.8 = 0.9; client 1: 0.5 + 0.008 + 0.0008
    assert r1.slowest == "0" and r1.round_s == pytest.approx(0.9)
    (_, m1) = emulate_run(res)  # measured train times instead of the model
    assert m1.slowest == "1" and m1.round_s == pytest.approx(4.0 + 0.0088)
    with pytest.raises(ValueError, match="no recorded link"):
        emulate_run(_results([(0.1, [], []), (0.2, [1], [1])]))


def test_a_client_that_never_answered_holds_the_round_for_the_timeout() -> None:
    res = _results([(0.1, [], []), (0.4, [1000, 1000], [100, 0])])
    (_, r1) = emulate_run(res, LinkProfile(100, 100))
    assert r1.slowest == "1" and r1.round_s == 30.0


def test_time_to_accuracy_and_speedup() -> None:
    dense = _results([(0.1, [], [])] + [(a, [1_724_320] * 2, [1_724_320] * 2) for a in (0.5, 0.8, 0.9)])
    comp = _results([(0.1, [], [])] + [(a, [d] * 2, [9_000] * 2) for a, d in ((0.4, 1_724_673), (0.7, 20_000), (0.85, 20_000), (0.91, 20_000))])
    rounds = emulate_run(dense, LinkProfile(10, 10), seconds_per_iter=0.0)
    assert time_to_accuracy(rounds, 0.9) == (pytest.approx(3 * 2 * 1.379456), 3)
    assert time_to_accuracy(rounds, 0.95) is None
    (row,) = compare(dense, comp, [10.0], 0.0, 0.0)
    assert row["target_accuracy"] == 0.9 and row["dense_rounds"] == 3 and row["compressed_rounds"] == 4
    expected_comp = (1_724_673 + 9_000 + 3 * (20_000 + 9_000)) * 8 / 10e6
    assert row["compressed_time_s"] == pytest.approx(expected_comp)
    assert row["speedup"] == pytest.approx(3 * 2 * 1.379456 / expected_comp)


def test_initial_model_free_drops_round_1_downlink_only() -> None:
    res = _results([(0.1, [], []), (0.5, [800_000], [0]), (0.6, [800_000], [100_000])])
    res["rounds"][1]["clients"]["uplink_bytes"] = [100_000]
    link = LinkProfile(8.0, 8.0)  # 1 MB/s both ways
    full = emulate_run(res, link, seconds_per_iter=0.0)
    free = emulate_run(res, link, seconds_per_iter=0.0, initial_model_free=True)
    assert [r.round_s for r in full] == pytest.approx([0, 0.9, 0.9])
    assert [r.round_s for r in free] == pytest.approx([0, 0.1, 0.9])
