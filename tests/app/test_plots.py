"""Plots of a run (fedcomp.app.plots): the PNGs exist and are real images, and what they draw is
what results.json says; bad run folders give a typed error naming the file, or exit 2."""

from __future__ import annotations

import itertools
import json
import os
import stat
from pathlib import Path

import pytest
from matplotlib.image import imread

from fedcomp.app.plots import (
    ACCURACY_PLOT,
    BYTES_PLOT,
    ResultsFileError,
    compression_settings,
    main,
    plot_runs,
    read_run,
    run_series,
    write_run_plots,
)
from fedcomp.app.results import RunRecorder

REPO = Path(__file__).resolve().parents[2]
MODEL = 431_080 * 4  # LeNet5-Caffe, fp32 bytes


def _recorded_run(root: Path, name: str, config: dict, rounds: int = 3, initial_model_sent: bool = True) -> Path:
    """A results.json written by the real RunRecorder: 2 clients, compressed traffic, the full
    model in round 1's downlink when ``initial_model_sent``."""
    rec = RunRecorder(config, root, name, stream=None)
    rec.end_round(0, accuracy=0.1, loss=2.3)
    for r in range(1, rounds + 1):
        for client in (3, 8):
            down = MODEL if (r == 1 and initial_model_sent) else (0 if r == 1 else 20_000 + 100 * r + client)
            rec.add_traffic(client, downlink_bytes=down, dense_downlink_bytes=MODEL if down else 0,
                            uplink_bytes=15_000 + 10 * r + client, dense_uplink_bytes=MODEL)  # fmt: skip
        rec.end_round(r, accuracy=0.1 + 0.25 * r, loss=2.0 / r)
    rec.finish()
    return rec.run_dir


def _check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 5_000 < path.stat().st_size < 500_000
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    image = imread(path)  # decodes the whole file
    height, width = image.shape[:2]
    assert 300 <= height <= 1200 and 500 <= width <= 1200
    assert image[..., :3].std() > 0.01  # something is drawn, not a blank canvas


def test_run_plots_are_pngs_of_the_numbers_in_results_json(tmp_path: Path) -> None:
    config = {"compress": True, "uplink-codec": "sbc", "sbc-p": 0.05, "downlink-codec": "3lc", "3lc-s": 1.0}
    run_dir = _recorded_run(tmp_path, "sbc-run", config)

    paths = write_run_plots(run_dir)

    assert paths == [run_dir / ACCURACY_PLOT, run_dir / BYTES_PLOT]
    for p in paths:
        _check_png(p)
    data = json.loads((run_dir / "results.json").read_text())
    series = read_run(run_dir)
    rounds = data["rounds"]
    assert series.rounds == (0, 1, 2, 3)
    assert series.accuracy == tuple(r["accuracy"] for r in rounds)
    total = [r["uplink_bytes"] + r["downlink_bytes"] for r in rounds]
    dense = [r["dense_uplink_bytes"] + r["dense_downlink_bytes"] for r in rounds]
    assert series.cumulative_bytes == tuple(itertools.accumulate(total))
    assert series.cumulative_dense_bytes == tuple(itertools.accumulate(dense))
    # The initial model went down in round 1 and is counted: 2 full models + 2 uplinks.
    assert series.cumulative_bytes[1] == 2 * MODEL + (15_013 + 15_018)
    assert (
        series.cumulative_bytes[-1] == data["summary"]["total_uplink_bytes"] + data["summary"]["total_downlink_bytes"]
    )
    assert series.uplink_bytes == tuple(r["uplink_bytes"] for r in rounds)
    assert series.dense_downlink_bytes == tuple(r["dense_downlink_bytes"] for r in rounds)
    assert series.compression == pytest.approx(sum(dense) / sum(total))
    assert series.label == "sbc-run: sbc p=0.05 up, 3lc s=1 down"


def test_a_run_with_no_rounds_or_a_failed_run_still_gets_readable_plots(tmp_path: Path) -> None:
    rec = RunRecorder({}, tmp_path, "empty", stream=None)
    rec.finish("failed", error="ConfigError: sbc-p: must be in (0, 0.5]")

    paths = write_run_plots(rec.run_dir)

    for p in paths:
        _check_png(p)
    series = read_run(rec.run_dir)
    assert series.rounds == () and series.cumulative_bytes == () and series.compression is None
    assert series.label == "empty: settings not recorded [failed]"
    assert series.error == "ConfigError: sbc-p: must be in (0, 0.5]"

    # A run that failed after round 0 only: no bytes moved yet.
    rec = RunRecorder({"compress": False}, tmp_path, "round0", stream=None)
    rec.end_round(0, accuracy=0.1, loss=2.3)
    rec.finish("failed", error="ConnectionError: SuperLink went away")
    for p in write_run_plots(rec.run_dir):
        _check_png(p)
    assert read_run(rec.run_dir).cumulative_bytes == (0,)


def test_overlay_labels_runs_by_name_and_settings(tmp_path: Path) -> None:
    dense = _recorded_run(tmp_path, "dense", {"compress": False})
    topk = _recorded_run(tmp_path, "topk", {"compress": True, "uplink-codec": "topk", "topk-density": 0.01,
                                            "downlink-codec": "dense-fp16", "seeded-initial-model": True},
                         initial_model_sent=False)  # fmt: skip
    out = tmp_path / "compare"

    paths = plot_runs([dense, topk], out)

    assert paths == [out / ACCURACY_PLOT, out / BYTES_PLOT]
    for p in paths:
        _check_png(p)
    assert [read_run(d).label for d in (dense, topk)] == [
        "dense: dense FedAvg (fp32)",
        "topk: topk density=0.01 up, dense-fp16 down, initial model not sent",
    ]
    assert read_run(topk).cumulative_bytes[1] == 15_013 + 15_018  # no initial model sent


@pytest.mark.parametrize(
    ("config", "text"),
    [
        ({}, "settings not recorded"),
        ({"compress": False, "uplink-codec": "sbc"}, "dense FedAvg (fp32)"),
        ({"compress": True, "uplink-codec": "stc", "sbc-p": 0.01, "downlink-codec": "identity"},
         "stc p=0.01 up, identity down"),
        ({"compress": True, "uplink-codec": "gradiveq", "gradiveq-eps": 0.3, "downlink-codec": "3lc", "3lc-s": 1.9},
         "gradiveq eps=0.3 up, 3lc s=1.9 down"),
        ({"compress": True, "uplink-codec": "sbc", "sbc-p": 0.05, "downlink-codec": "lattice", "lattice-step": 12.0},
         "sbc p=0.05 up, lattice step=12 down"),
        ({"compress": True, "uplink-codec": "deft", "topk-density": "0.1:0.01@10"},
         "deft density=0.1:0.01@10 up, 3lc down"),
    ],
)  # fmt: skip
def test_compression_settings_text(config: dict, text: str) -> None:
    assert compression_settings(config) == text


def _results_with(tmp_path: Path, content: str) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "results.json").write_text(content)
    return run_dir


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"status": "completed"}', "no 'rounds' list"),
        ('{"rounds": {}}', "'rounds': expected a list, got dict"),
        ('{"rounds": [{"round": 0, "accuracy": 0.1}]}', "rounds[0] has no 'uplink_bytes'"),
        ('{"rounds": [{"round": 1, "accuracy": "high", "uplink_bytes": 1, "downlink_bytes": 1,'
         ' "dense_uplink_bytes": 1, "dense_downlink_bytes": 1}]}', "rounds[0].accuracy: expected a number, got 'high'"),
        ('{"rounds": [{"round": 1, "accuracy": 0.5, "uplink_bytes": -4, "downlink_bytes": 1,'
         ' "dense_uplink_bytes": 1, "dense_downlink_bytes": 1}]}', "rounds[0].uplink_bytes: expected a whole number"),
        ('{"rounds": [], "config": "x"}', "'config': expected an object"),
    ],
)  # fmt: skip
def test_a_bad_results_file_is_a_typed_error_naming_file_and_field(tmp_path: Path, content: str, reason: str) -> None:
    run_dir = _results_with(tmp_path, content)
    with pytest.raises(ResultsFileError) as info:
        write_run_plots(run_dir)
    assert info.value.path == run_dir / "results.json"
    assert reason in info.value.reason and str(run_dir / "results.json") in str(info.value)
    assert not (run_dir / ACCURACY_PLOT).exists()


def test_missing_run_folder_or_file(tmp_path: Path) -> None:
    with pytest.raises(ResultsFileError, match="no such run folder"):
        read_run(tmp_path / "nope")
    with pytest.raises(ResultsFileError, match="no results.json in this folder"):
        read_run(tmp_path)


def test_plot_command_exit_codes_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _recorded_run(tmp_path, "a", {"compress": False})
    b = _recorded_run(tmp_path, "b", {"compress": True})
    (a / ACCURACY_PLOT).unlink(missing_ok=True)

    assert main([str(a)]) == 0  # one run: beside its results.json
    assert capsys.readouterr().out.split() == [str(a / ACCURACY_PLOT), str(a / BYTES_PLOT)]
    _check_png(a / ACCURACY_PLOT)

    out = tmp_path / "overlay"
    assert main([str(a), str(b / "results.json"), "--out", str(out)]) == 0  # a file path works too
    assert capsys.readouterr().out.split() == [str(out / ACCURACY_PLOT), str(out / BYTES_PLOT)]

    assert main([str(a), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(tmp_path / "missing") in err and "no such run folder" in err
    bad = _results_with(tmp_path, '{"rounds": [{"round": 0}]}')
    assert main([str(bad)]) == 2
    assert "rounds[0] has no 'accuracy'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main([])  # RUN_DIR is required: argparse's usage error
    assert info.value.code == 2


def test_run_series_is_pure(tmp_path: Path) -> None:
    data = {"run_name": "x", "status": "completed", "config": {"compress": False}, "rounds": [
        {"round": 0, "accuracy": None, "uplink_bytes": 0, "downlink_bytes": 0, "dense_uplink_bytes": 0,
         "dense_downlink_bytes": 0},
        {"round": 1, "accuracy": 0.5, "uplink_bytes": 7, "downlink_bytes": 5, "dense_uplink_bytes": 7,
         "dense_downlink_bytes": 5},
    ]}  # fmt: skip
    s = run_series(data, tmp_path / "results.json")
    assert s.cumulative_bytes == (0, 12) and s.compression == 1.0
    assert s.accuracy[0] != s.accuracy[0] and s.accuracy[1] == 0.5  # null accuracy (NaN in the run) is NaN


@pytest.mark.slow
@pytest.mark.flower
def test_plots_of_a_real_flower_run(tmp_path: Path) -> None:
    from fedcomp.testing.flower import run_simulation

    results = run_simulation(
        REPO,
        {"num-server-rounds": 2, "results-dir": str(tmp_path / "results"), "run-name": "real"},
        num_supernodes=2,
        timeout_s=300,
        work_dir=tmp_path / "work",
    )
    run_dir = tmp_path / "results" / "real"
    paths = write_run_plots(run_dir)
    for p in paths:
        _check_png(p)
    series = read_run(run_dir)
    assert series.rounds == (0, 1, 2) and series.status == "completed"
    assert series.accuracy == tuple(r["accuracy"] for r in results["rounds"])
    assert series.cumulative_bytes[-1] == (
        results["summary"]["total_uplink_bytes"] + results["summary"]["total_downlink_bytes"]
    )
    assert series.compression is not None and series.compression > 10  # SBC + lattice by default
    assert "sbc p=0.05 up, lattice step=12 down" in series.label
    assert os.access(run_dir / "results.json", os.R_OK)


def test_rounds_that_aggregated_no_update_are_marked(tmp_path: Path) -> None:
    """Every client failing from round 2 on: rounds 2 and 3 moved the model down but no update
    came back (``updates_aggregated`` = 0, as the ServerApp records it)."""
    rec = RunRecorder({"compress": False}, tmp_path, "failing", stream=None)
    rec.end_round(0, accuracy=0.1, loss=2.3)
    for r in (1, 2, 3):
        rec.add_traffic(1, downlink_bytes=MODEL, dense_downlink_bytes=MODEL)
        if r == 1:
            rec.add_traffic(1, uplink_bytes=MODEL, dense_uplink_bytes=MODEL)
        rec.end_round(r, accuracy=0.5 if r == 1 else 0.5, loss=1.0, updates_aggregated=int(r == 1))
    rec.finish("failed", error="no client update was aggregated in 2 rounds in a row")

    for p in write_run_plots(rec.run_dir):
        _check_png(p)
    series = read_run(rec.run_dir)
    assert series.empty_rounds == (2, 3)
    assert series.cumulative_bytes == (0, 2 * MODEL, 3 * MODEL, 4 * MODEL)
    assert read_run(_recorded_run(tmp_path, "ok", {})).empty_rounds == ()  # not recorded: none marked
