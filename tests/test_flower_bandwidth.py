"""A real Flower simulation with per-client links and a round deadline: each client's bandwidth
policy picks its own p (and local iterations), or dense fp32 where that uploads sooner with codec
time counted, and results.json records them."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedcomp.app.models import LeNet5Caffe
from fedcomp.methods.bandwidth import estimate_dense_bytes
from fedcomp.testing.flower import run_simulation

# Real `flwr run` simulations (10 s to a minute each on 2 cores): out of the fast lane.
pytestmark = [pytest.mark.flower, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def test_slow_and_fast_links_get_their_own_p_and_a_fast_link_goes_dense(tmp_path: Path) -> None:
    """Round 1: no codec time measured yet, bytes decide: both compress, each at its own p.
    Round 2: each client has timed its SBC encode and dense fp32 encodes in round 1; on the
    1 Tbit/s link the dense update's bytes cost microseconds, so dense uploads sooner (an fp32
    copy encodes faster than SBC's selection and Golomb coding) and the client sends its whole
    update dense; on the 10 kbit/s link dense would take 20 minutes: it compresses."""
    # Partition 0: 0.01 Mbit/s up (1.25 kB/s), partition 1: 1 Tbit/s up; both 100 Mbit/s down.
    run_config = {
        "dataset": "digits", "num-server-rounds": 2, "local-iters": 10, "sbc-p": 0.01,
        "link-profiles": "0.01,100,10;1000000,100,5", "round-deadline-s": 6.0,
        "sbc-p-min": 0.0005, "sbc-p-max": 0.1, "adapt-local-iters": True, "local-iters-max": 100,
        "seconds-per-iter": 0.01,  # the deadline's compute model (measured times are noisy here)
        "results-dir": str(tmp_path / "results"), "run-name": "bw",
    }  # fmt: skip
    res = run_simulation(REPO, run_config, num_supernodes=2, timeout_s=300, work_dir=tmp_path / "work")
    assert res["status"] == "completed"
    dense_bytes = estimate_dense_bytes([(k, v.numel()) for k, v in LeNet5Caffe().state_dict().items()])
    numel = sum(v.numel() for v in LeNet5Caffe().state_dict().values())
    for r in res["rounds"][1:]:
        links = r["client_links"]
        assert sorted(links.values()) == [[0.01, 100.0, 10.0], [1e6, 100.0, 5.0]]
        slow = next(n for n, v in links.items() if v[0] == 0.01)
        fast = next(n for n, v in links.items() if v[0] == 1e6)
        p, iters, budget = r["client_sbc_p"], r["client_local_iters"], r["client_budget_bytes"]
        assert iters[fast] == 100  # p-max fits; iterations scale with p
        assert 0.0005 <= p[slow] < 0.01 and iters[slow] < 10  # a smaller p after fewer steps
        assert r["client_fits"] == {slow: True, fast: True}
        assert r["rejected"] == {} and r["num_clients"] == 2  # both replies aggregated
        ids = r["clients"]["ids"]
        sent = dict(zip(ids, r["clients"]["uplink_bytes"], strict=True))
        assert sent[slow] <= budget[slow] * 1.05  # the real upload honours the budget
        assert sent[slow] < 0.05 * 4 * numel  # compressed
        # Same total sparsity p / iterations on both (up to the rounding of iterations).
        assert abs(p[slow] / iters[slow] - 0.001) / 0.001 < 0.5
        assert r["client_codec"] == {slow: "sbc", fast: "sbc" if r["round"] == 1 else "dense-fp32"}
        if r["round"] == 1:
            assert p[fast] == 0.1 and p[fast] / iters[fast] == pytest.approx(0.001)
            assert budget[slow] * 1.05 < sent[fast] < 0.2 * 4 * numel  # SBC at p-max
        else:
            assert fast not in p  # no p: the policy replaced SBC by dense fp32
            assert r["client_estimated_bytes"][fast] == dense_bytes
            assert sent[fast] > 4 * numel  # every value as fp32: only a dense update is this big
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
    iteration it used: they must be exactly what it measured in the earlier rounds. From round 2
    on the deadline also pays the client's codec time (its fastest encode and downlink apply).
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
    best_encode: dict[str, float] = {}  # node -> fastest encode seconds reported so far
    for r in rounds[1:]:
        down = dict(zip(r["clients"]["ids"], r["clients"]["downlink_bytes"], strict=True))
        for node in nodes:
            assert r["client_local_iters"][node] == iters  # adapt-local-iters is off
            assert r["client_fits"][node] is True
            # What the budget leaves for compute, in seconds per iteration (int() cut <= 1 byte).
            spare = deadline - 2 * latency_ms / 1000 - down[node] / down_rate
            # What the budget leaves beyond the transfer: compute, then codec time (the client's
            # fastest encode so far plus its fastest downlink apply; none in round 1).
            implied = spare - r["client_budget_bytes"][node] / up_rate
            codec = implied - iters * best.get(node, 0.0)
            tol = 1 / up_rate + 1e-9
            if node not in best_encode:
                assert codec == pytest.approx(0.0, abs=tol), (r["round"], node)
            else:  # at least the encode it reported; the downlink apply of LeNet5 takes milliseconds
                assert best_encode[node] - tol <= codec < best_encode[node] + 0.5, (r["round"], node, codec)
            measured = r["client_train_seconds"][node] / iters
            assert measured > 1e-3  # LeNet5 steps on a CPU: milliseconds each, never free
            best[node] = min(measured, best.get(node, measured))
            enc = r["client_encode_seconds"][node]
            best_encode[node] = min(enc, best_encode.get(node, enc))
    r1, r2 = rounds[1], rounds[2]
    for node in nodes:
        # Round 2 reserves the compute measured in round 1 (20 iterations: >= 20 ms, measured
        # 0.3 s to 2.3 s); the downloads of the two rounds differ by at most a model, 14 ms at
        # 1 Gbit/s: a smaller budget, so a smaller p.
        assert r2["client_budget_bytes"][node] < r1["client_budget_bytes"][node]
        assert r2["client_sbc_p"][node] < r1["client_sbc_p"][node] < 0.1  # inside [p-min, p-max]: p is free
