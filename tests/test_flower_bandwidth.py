"""A real Flower simulation with per-client links and a round deadline: each client's bandwidth
policy picks its own p (and local iterations), and results.json records them."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedcomp.testing.flower import run_simulation

# Real `flwr run` simulations (10 s to a minute each on 2 cores): out of the fast lane.
pytestmark = [pytest.mark.flower, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def test_slow_and_fast_links_get_their_own_p(tmp_path: Path) -> None:
    # Partition 0: 0.01 Mbit/s up (1.25 kB/s), partition 1: 20 Mbit/s up; both 100 Mbit/s down.
    run_config = {
        "dataset": "digits", "num-server-rounds": 2, "local-iters": 10, "sbc-p": 0.01,
        "link-profiles": "0.01,100,10;20,100,5", "round-deadline-s": 5.0,
        "sbc-p-min": 0.0005, "sbc-p-max": 0.1, "adapt-local-iters": True, "local-iters-max": 100,
        "seconds-per-iter": 0.01,  # the deadline's compute model (measured times are noisy here)
        "results-dir": str(tmp_path / "results"), "run-name": "bw",
    }  # fmt: skip
    res = run_simulation(REPO, run_config, num_supernodes=2, timeout_s=300, work_dir=tmp_path / "work")
    assert res["status"] == "completed"
    for r in res["rounds"][1:]:
        links = r["client_links"]
        assert sorted(links.values()) == [[0.01, 100.0, 10.0], [20.0, 100.0, 5.0]]
        slow = next(n for n, v in links.items() if v[0] == 0.01)
        fast = next(n for n, v in links.items() if v[0] == 20.0)
        p, iters, budget = r["client_sbc_p"], r["client_local_iters"], r["client_budget_bytes"]
        assert p[fast] == 0.1 and iters[fast] == 100  # p-max fits; iterations scale with p
        assert 0.0005 <= p[slow] < 0.01 and iters[slow] < 10  # a smaller p after fewer steps
        assert r["client_fits"] == {slow: True, fast: True}
        ids = r["clients"]["ids"]
        sent = dict(zip(ids, r["clients"]["uplink_bytes"], strict=True))
        assert sent[slow] <= budget[slow] * 1.05 < sent[fast]  # the real upload honours the budget
        # Same total sparsity p / iterations on both (up to the rounding of iterations).
        assert abs(p[slow] / iters[slow] - 0.001) / 0.001 < 0.5
        assert p[fast] / iters[fast] == pytest.approx(0.001)
    # Measured 0.916 after 2 rounds (0.805 after 1): the fast client's 100 iterations dominate
    # the mean. A server that lost either client's update, or took the slow client's 2-step
    # model at full weight, would not get there in 2 rounds.
    assert res["rounds"][2]["accuracy"] > 0.88, [r["accuracy"] for r in res["rounds"]]


def test_measured_compute_time_shrinks_the_next_rounds_upload(tmp_path: Path) -> None:
    """``seconds-per-iter = 0``: no compute model, each client times its own training.

    Round 1 has no measurement yet, so the deadline only pays for latency and the download.
    From round 2 on, the policy also reserves ``local-iters x`` the fastest seconds per iteration
    the client has measured (its train handler's wall time / its iterations), so the upload
    budget, and with it p, shrinks. The budget the client reports pins down the seconds per
    iteration it used: they must be exactly what it measured in the earlier rounds.
    """
    # 2.5 kB/s up: round 1's budget is ~25 kB (p ~ 0.065, inside [p-min, p-max], so p can move
    # both ways); 1 Gbit/s down makes the download's share of the deadline negligible. The
    # deadline is generous: round 1's measurement includes warm-up (measured 0.3 s and 2.3 s on
    # two loaded cores) and must still leave room for p-min.
    up_mbps, down_mbps, latency_ms, deadline, iters = 0.02, 1000.0, 10.0, 10.0, 20
    run_config = {
        "dataset": "digits", "num-server-rounds": 3, "local-iters": iters, "sbc-p": 0.01,
        "link-profiles": f"{up_mbps},{down_mbps},{latency_ms}", "round-deadline-s": deadline,
        "sbc-p-min": 0.0005, "sbc-p-max": 0.1, "seconds-per-iter": 0.0,
        "results-dir": str(tmp_path / "results"), "run-name": "measured",
    }  # fmt: skip
    res = run_simulation(REPO, run_config, num_supernodes=2, timeout_s=300, work_dir=tmp_path / "work")
    up_rate, down_rate = up_mbps * 1e6 / 8, down_mbps * 1e6 / 8  # bytes/s
    rounds = res["rounds"]
    nodes = rounds[1]["clients"]["ids"]
    best: dict[str, float] = {}  # node -> fastest seconds per iteration measured so far
    for r in rounds[1:]:
        down = dict(zip(r["clients"]["ids"], r["clients"]["downlink_bytes"], strict=True))
        for node in nodes:
            assert r["client_local_iters"][node] == iters  # adapt-local-iters is off
            assert r["client_fits"][node] is True
            # What the budget leaves for compute, in seconds per iteration (int() cut <= 1 byte).
            spare = deadline - 2 * latency_ms / 1000 - down[node] / down_rate
            implied = (spare - r["client_budget_bytes"][node] / up_rate) / iters
            assert implied == pytest.approx(best.get(node, 0.0), abs=1 / up_rate / iters + 1e-9), (r["round"], node)
            measured = r["client_train_seconds"][node] / iters
            assert measured > 1e-3  # LeNet5 steps on a CPU: milliseconds each, never free
            best[node] = min(measured, best.get(node, measured))
    r1, r2 = rounds[1], rounds[2]
    for node in nodes:
        # Round 2 reserves the compute measured in round 1 (20 iterations: >= 20 ms, measured
        # 0.3 s to 2.3 s); the downloads of the two rounds differ by at most a model, 14 ms at
        # 1 Gbit/s: a smaller budget, so a smaller p.
        assert r2["client_budget_bytes"][node] < r1["client_budget_bytes"][node]
        assert r2["client_sbc_p"][node] < r1["client_sbc_p"][node] < 0.1  # inside [p-min, p-max]: p is free
