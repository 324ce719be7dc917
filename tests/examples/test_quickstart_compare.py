"""The quickstart-style example's two copies and its comparison script (issue #12, item 7).

* ``examples/quickstart/plain`` and ``.../compressed`` differ only by the two lines that add
  compression (and their imports); the pyproject files only by compression keys.
* ``examples/quickstart/compare.py``: bad arguments exit 2 naming the option, before anything runs;
  the table and the verdict are computed from each run's own results files (here small fake ones,
  written as the apps write them: results.json and final_model.pt); an unfinished or failed run
  is never taken from the cache. No Flower run here (the real runs take minutes each).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from fedcomp.flower.settings import CompressionConfig

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"


def _compare() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quickstart_compare", QUICKSTART / "compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


compare = _compare()


# --- the two copies ------------------------------------------------------------------------------


def _app_files(app: Path) -> set[str]:
    return {
        str(p.relative_to(app)) for p in app.rglob("*") if p.suffix in (".py", ".toml") and ".mypy_cache" not in p.parts
    }


def test_the_two_copies_differ_only_by_the_two_compression_lines() -> None:
    plain, compressed = QUICKSTART / "plain", QUICKSTART / "compressed"
    assert _app_files(plain) == _app_files(compressed)
    changed: dict[str, list[str]] = {}
    for name in sorted(_app_files(plain) - {"pyproject.toml"}):
        a = (plain / name).read_text().splitlines()
        b = (compressed / name).read_text().splitlines()
        diff = [d for d in difflib.ndiff(a, b) if d[:2] in ("- ", "+ ")]
        if diff:
            changed[name] = diff
    assert changed == {
        "mnistquick/client_app.py": [
            "+ from fedcomp.flower.mod import compression_mod",
            "- app = ClientApp()",
            "+ app = ClientApp(mods=[compression_mod])",
        ],
        "mnistquick/server_app.py": [
            "+ from fedcomp.flower.settings import CompressionConfig",
            "+ from fedcomp.flower.strategy import CompressionStrategy",
            "-     strategy = FedAvg(fraction_evaluate=fraction_evaluate)",
            "+     strategy = CompressionStrategy(FedAvg(fraction_evaluate=fraction_evaluate), "
            "CompressionConfig.from_run_config(rc))",
        ],
    }


def test_the_two_pyprojects_differ_only_by_compression_keys() -> None:
    tables = [tomllib.loads((QUICKSTART / app / "pyproject.toml").read_text()) for app in ("plain", "compressed")]
    configs = [t["tool"]["flwr"]["app"].pop("config") for t in tables]
    assert tables[0] == tables[1]
    compression_keys = CompressionConfig.keys()
    assert not compression_keys & set(configs[0]), "the plain app must not carry compression keys"
    own = {k: v for k, v in configs[1].items() if k not in compression_keys}
    assert own == configs[0]
    # The compressed app declares the fedcomp keys it lets --run-config set, at fedcomp's defaults
    # (declaring a key must not change the run).
    declared = {k: v for k, v in configs[1].items() if k in compression_keys}
    assert declared and CompressionConfig.from_run_config(declared) == CompressionConfig()


# --- arguments -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seeds", "0,x"], "--seeds: expected comma-separated integers"),
        (["--seeds", ""], "--seeds: expected comma-separated integers"),
        (["--seeds", "0,0"], "--seeds: a value is repeated"),
        (["--seeds", "-1"], "--seeds: every value must be >= 0"),
        (["--rounds", "0"], "--rounds: must be >= 1 (got 0)"),
        (["--rounds", "20", "--at", "10,30"], "--at: round 30 is after the last round (--rounds 20)"),
        (["--at", "0"], "--at: every value must be >= 1"),
        (["--nodes", "0"], "--nodes: must be >= 1 (got 0)"),
        (["--compressed-config", "sbc-pp=0.1"], "--compressed-config: unknown key 'sbc-pp'"),
        (["--compressed-config", "seed=3"], "--compressed-config: 'seed' is set by this script"),
        (["--compressed-config", "=3"], "--compressed-config: run config: cannot read"),
    ],
)
def test_bad_arguments_exit_2_naming_the_option(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = compare.main([*args, "--results-dir", str(tmp_path), "--report-only"])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing written


def test_a_missing_data_folder_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FEDCOMP_DATA_DIR", str(tmp_path / "nowhere"))
    code = compare.main(["--results-dir", str(tmp_path)])
    assert code == 2 and "FEDCOMP_DATA_DIR must name the folder holding mnist/" in capsys.readouterr().err


# --- the table from fake results files -----------------------------------------------------------

PARAMS = 15  # the fake model: 10 + 5 values
NODES = 2
PLAIN_PER_ROUND = 2 * NODES * 4 * PARAMS  # one model to each client and one back, fp32: 240 B


def _write_run(
    root: Path,
    name: str,
    accuracy: list[float],
    total: list[int] | None = None,
    dense: list[int] | None = None,
    status: str = "completed",
) -> Path:
    """A run folder as the apps leave it: results.json (status, rounds from 0, train_metrics) and
    final_model.pt (a state dict)."""
    folder = root / name
    folder.mkdir(parents=True)
    train: dict[str, dict[str, Any]] = {}
    for r in range(1, len(accuracy)):
        m: dict[str, Any] = {"train_loss": 0.5}
        if total is not None and dense is not None:
            m.update({"fedcomp.total-bytes": total[r - 1], "fedcomp.total-dense-bytes": dense[r - 1]})
        train[str(r)] = m
    rounds = [{"round": r, "accuracy": a, "loss": 1.0} for r, a in enumerate(accuracy)]
    (folder / "results.json").write_text(json.dumps({"status": status, "rounds": rounds, "train_metrics": train}))
    torch.save({"w": torch.zeros(2, 5), "b": torch.zeros(5)}, folder / "final_model.pt")
    return folder


def _fake_pair(root: Path, seed: int, plain_acc: list[float], comp_acc: list[float], comp_total: list[int]) -> None:
    dense = [PLAIN_PER_ROUND * r for r in range(1, len(plain_acc))]
    _write_run(root, f"plain-seed{seed}-r2-n{NODES}", plain_acc)
    _write_run(root, f"compressed-seed{seed}-r2-n{NODES}", comp_acc, comp_total, dense)


def _report(root: Path, *extra: str) -> int:
    return compare.main(
        ["--seeds", "0,1", "--rounds", "2", "--at", "1,2", "--nodes", str(NODES), "--results-dir", str(root),
         "--report-only", *extra]
    )  # fmt: skip


def test_the_table_reads_each_seeds_results_and_averages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Seed 0: compressed 1 pp behind at r1, 3 pp at r2; seed 1: 3 pp and 0 pp behind. Bytes: 24 + 16 and 36 + 12.
    _fake_pair(tmp_path, 0, [0.1, 0.90, 0.95], [0.1, 0.89, 0.92], [24, 40])
    _fake_pair(tmp_path, 1, [0.1, 0.80, 0.97], [0.1, 0.77, 0.97], [36, 48])
    assert _report(tmp_path) == 0
    out = capsys.readouterr().out
    lines = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    # r1: 240 B plain against 24 B (10x); r2: 480 against 40 (12x).
    assert lines["seed 0"] == (
        "| seed 0 | 0.9000 | 0.8900 | +1.00 | 0.00 / 0.000 | 10.0x | 0.9500 | 0.9200 | +3.00 | 0.00 / 0.000 | 12.0x |"
    )
    # Mean: r1 gap (1 + 3) / 2 = 2 pp, r2 (3 + 0) / 2 = 1.5 pp; ratio r2 = 480 / mean(40, 48) = 10.9x.
    mean = lines["mean of 2"].split(" | ")
    assert mean[1:4] == ["0.8500", "0.8300", "+2.00"]
    assert mean[5] == f"{240 / 30:.1f}x"
    assert mean[6:9] == ["0.9600", "0.9450", "+1.50"]
    assert mean[10] == f"{480 / 44:.1f}x |"
    assert "r1 +2.00 pp, r2 +1.50 pp, 10.9x: met" in out
    assert _report(tmp_path, "--check") == 0


def test_a_missed_target_is_said_and_fails_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_pair(tmp_path, 0, [0.1, 0.90, 0.95], [0.1, 0.89, 0.92], [24, 40])
    _fake_pair(tmp_path, 1, [0.1, 0.80, 0.97], [0.1, 0.75, 0.97], [36, 48])  # r1 mean gap 3 pp
    assert _report(tmp_path) == 0
    assert "r1 +3.00 pp, r2 +1.50 pp, 10.9x: NOT met" in capsys.readouterr().out
    assert _report(tmp_path, "--check") == 1


def test_too_few_bytes_saved_misses_the_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_pair(tmp_path, 0, [0.1, 0.90, 0.95], [0.1, 0.90, 0.95], [24, 60])
    _fake_pair(tmp_path, 1, [0.1, 0.90, 0.95], [0.1, 0.90, 0.95], [24, 60])  # 480 / 60 = 8x
    assert _report(tmp_path, "--check") == 1
    assert "8.0x: NOT met" in capsys.readouterr().out


def test_a_failed_or_unfinished_run_is_not_taken_from_the_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_pair(tmp_path, 0, [0.1, 0.90, 0.95], [0.1, 0.89, 0.92], [24, 40])
    _write_run(tmp_path, f"plain-seed1-r2-n{NODES}", [0.1, 0.9, 0.95], status="failed")
    _write_run(tmp_path, f"compressed-seed1-r2-n{NODES}", [0.1, 0.9], [24], [240])  # one round of two
    assert _report(tmp_path) == 1
    err = capsys.readouterr().err
    assert f"not cached (run without --report-only): plain-seed1-r2-n{NODES}, compressed-seed1-r2-n{NODES}" in err


def test_bytes_counted_differently_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The compressed run saw 3 clients' worth of dense bytes where plain counts 2: not comparable.
    _write_run(tmp_path, f"plain-seed0-r2-n{NODES}", [0.1, 0.9, 0.95])
    _write_run(tmp_path, f"compressed-seed0-r2-n{NODES}", [0.1, 0.9, 0.95], [24, 40], [360, 720])
    code = compare.main(["--seeds", "0", "--rounds", "2", "--nodes", str(NODES), "--results-dir", str(tmp_path),
                         "--report-only"])  # fmt: skip
    assert code == 1
    assert "seed 0, round 1: plain counted 240 B but the compressed run's dense equivalent is 360 B" in (
        capsys.readouterr().err
    )


def test_a_compressed_run_without_bytes_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_run(tmp_path, f"plain-seed0-r2-n{NODES}", [0.1, 0.9, 0.95])
    _write_run(tmp_path, f"compressed-seed0-r2-n{NODES}", [0.1, 0.9, 0.95])  # no fedcomp.* metrics
    code = compare.main(["--seeds", "0", "--rounds", "2", "--nodes", str(NODES), "--results-dir", str(tmp_path),
                         "--report-only"])  # fmt: skip
    assert code == 1
    assert "compressed seed 0: round 1 has no fedcomp.total-bytes" in capsys.readouterr().err


def test_overrides_of_the_compressed_app_get_their_own_cache_name() -> None:
    base = compare.run_name("compressed", 0, 20, 10, {})
    assert base == "compressed-seed0-r20-n10"
    a = compare.run_name("compressed", 0, 20, 10, {"sbc-p": 0.1})
    assert a.startswith(base + "-") and a != compare.run_name("compressed", 0, 20, 10, {"sbc-p": 0.2})
