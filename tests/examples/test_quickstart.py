"""A user's own Flower app, written like Flower's quickstart and wrapped with the two lines
(``examples/quickstart/compressed``): the compression figures reach Flower's own channels, the
``Result`` that ``strategy.start`` returns (saved by the app) and the run's log."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from fedcomp.testing.flower import run_simulation

pytestmark = [pytest.mark.flower, pytest.mark.slow]

APP = Path(__file__).resolve().parents[2] / "examples" / "quickstart"
DATA = os.environ.get("FEDCOMP_DATA_DIR", "")


@pytest.mark.skipif(not (Path(DATA) / "mnist").is_dir(), reason="needs FEDCOMP_DATA_DIR with mnist/")
def test_the_wrapped_quickstart_reports_compression_through_flower(tmp_path: Path) -> None:
    results = run_simulation(
        APP / "compressed",
        {"num-server-rounds": 2, "batch-size": 256},
        num_supernodes=4,
        timeout_s=600,
        env={"FEDCOMP_DATA_DIR": os.path.relpath(DATA)},  # relative, as a user may write it
        work_dir=tmp_path,
        keep_work_dir=True,
    )
    params = 44_426  # the quickstart Net: 4 x params bytes per dense model
    for rnd in ("1", "2"):
        m = results["train_metrics"][rnd]
        # Every train reply decoded; 4 clients each sent one compressed update.
        assert m["fedcomp.replies-accepted"] == 4 and m["fedcomp.replies-rejected"] == 0
        assert m["fedcomp.uplink-dense-bytes"] == 4 * 4 * params
        # SBC (default p = 5 %) on the three big tensors, the 1,226 values of tensors under
        # min-compress-numel dense: those dominate, ~4.9 kB of ~6.5 kB: 27x (31x at p = 1 %). A
        # dense uplink gives 1x, fp16 2x, top-k with fp32 values at 5 % under 10x.
        assert 25 < m["fedcomp.uplink-ratio"] < 40, m
        assert m["fedcomp.uplink-bytes"] * m["fedcomp.uplink-ratio"] == pytest.approx(m["fedcomp.uplink-dense-bytes"])
    # Round 1 sends the full initial model (dense); round 2 a 3LC delta, far smaller.
    r1, r2 = results["train_metrics"]["1"], results["train_metrics"]["2"]
    assert r1["fedcomp.downlink-ratio"] == pytest.approx(1.0, rel=0.01)
    assert r2["fedcomp.downlink-ratio"] > 15, r2
    # Totals add up over the run (both directions, train rounds; no evaluate rounds here).
    total = sum(
        results["train_metrics"][r][k] for r in ("1", "2") for k in ("fedcomp.uplink-bytes", "fedcomp.downlink-bytes")
    )
    assert r2["fedcomp.total-bytes"] == total
    # The run's log shows the settings at start and one line per round.
    log = (tmp_path / "flwr-run.log").read_text(errors="replace")
    assert "fedcomp: compressing both ways: uplink sbc" in log
    lines = re.findall(r"fedcomp: round (\d+): uplink (\d+) B \(x([\d.]+)\)", log)
    assert [int(r) for r, _, _ in lines] == [1, 2]
    assert int(lines[1][1]) == r2["fedcomp.uplink-bytes"]
    # The app's own accuracy is there too, beside the figures, and it learns: 0.35 after two
    # short rounds of 59 batches (chance, and the initial model, are at 0.1). How far compressed
    # training trails plain training is measured by `examples/quickstart/compare.py`, not here.
    acc = [r["accuracy"] for r in results["rounds"]]
    assert len(acc) == 3 and acc[2] > acc[0] + 0.15, json.dumps(results["rounds"])
