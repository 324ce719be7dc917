"""No update is lost, in a real Flower simulation (``flwr run`` against a local SuperLink): some
replies are cut in transit (rejected) or fail (never arrive), and at the end, per client,

    sum(updates the server aggregated) + residual == sum(local updates)   (fp32 tolerance)

The app (tests/flower/lost_app) is the real CompressionStrategy and compression_mod around a
deterministic "training"; both sides write what the check needs into the run folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedcomp.testing.flower import run_simulation

pytestmark = [pytest.mark.flower, pytest.mark.slow]

APP = Path(__file__).resolve().parent / "lost_app"


@pytest.mark.parametrize("method", ["sbc"])
def test_no_update_is_lost_in_a_real_simulation(tmp_path: Path, method: str) -> None:
    config = {"results-dir": str(tmp_path / "results"), "run-name": "lost", "uplink-codec": method, "rounds": 5,
              "faults": "2:0:truncate,3:1:error,4:0:error,4:2:truncate"}  # fmt: skip
    run_simulation(APP, config, num_supernodes=3, timeout_s=300, work_dir=tmp_path / "work")
    run_dir = tmp_path / "results" / "lost"
    server = torch.load(run_dir / "server.pt")
    nodes = server["nodes"]
    assert len(nodes) == 3
    # The faults happened: two rejections; the two failed replies reached the server as errors
    # (what Flower delivers when a ClientApp fails), which carry no update.
    rejected = {r: sorted(nodes.index(n) for n in got) for r, got in server["rejected"].items() if got}
    assert rejected == {2: [0], 4: [2]}, server["rejected"]
    assert not any(server["missing"].values())
    for node in nodes:
        client = torch.load(run_dir / f"client-{node}.pt")
        assert not client["pending"]  # the last round's evaluate messages settled everything
        local = [torch.load(run_dir / f"delta-{node}-{r}.pt") for r in range(1, 6)]
        aggregated = [
            {k: got[node][k] - server["models"][r][k] for k in got[node]}
            for r, got in server["aggregated"].items()
            if node in got
        ]
        # Index 0 lost rounds 2 and 4, index 1 round 3, index 2 round 4.
        assert len(aggregated) == {0: 3, 1: 4, 2: 4}[nodes.index(node)]
        for k in local[0]:
            lhs = sum(a[k].double() for a in aggregated) + client["residual"].get(k, torch.zeros(1)).double()
            rhs = sum(d[k].double() for d in local)
            torch.testing.assert_close(lhs, rhs, rtol=0, atol=2e-6, msg=f"node index {nodes.index(node)}, {k}")
