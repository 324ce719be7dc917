"""A real Flower simulation with per-client links and a round deadline: each client's bandwidth
policy picks its own p (and local iterations), and results.json records them."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedcomp.testing.flower import run_simulation

pytestmark = pytest.mark.flower

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
    assert res["rounds"][2]["accuracy"] > res["rounds"][0]["accuracy"] + 0.2
