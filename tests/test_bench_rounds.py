"""``python -m fedcomp.bench rounds``: its argument errors, and tiny real runs through the wrapper
and the mod beside plain FedAvg."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedcomp.bench.__main__ import main as bench_main
from fedcomp.bench.rounds import main
from tests.usage import usage_error

STEPS = ("configure", "client_mod", "client_app", "aggregate")


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--clients", "0"], "--clients"),
        (["--rounds", "1"], "--rounds"),  # (the first round is left out of the medians)
        (["--model", "vgg"], "--model"),
        (["--seed", "x"], "--seed"),
    ],
)
def test_bad_arguments_are_usage_errors_naming_the_option(
    argv: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert names in usage_error(main, argv, capsys)


def test_a_run_config_key_the_wrapper_does_not_have_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(main, ["--model", "lenet", "--rounds", "2", "--no-baseline", "-c", "sbc-p=0.1 sbc-q=0.1"], capsys)
    assert "--run-config" in err and "'sbc-q'" in err and "'sbc-p'" not in err


def test_a_bad_run_config_value_is_named() -> None:
    from fedcomp.errors import ConfigError

    with pytest.raises(ConfigError, match="sbc-p"):
        main(["--model", "lenet", "--rounds", "2", "--no-baseline", "--run-config", "sbc-p=7"])


def test_a_tiny_run_times_every_step_beside_plain_fedavg(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rounds.json"
    assert bench_main(["rounds", "--model", "lenet", "--clients", "2", "--rounds", "3", "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert (row["model"], row["tensors"], row["numel"], row["clients"], row["rounds"]) == ("lenet", 8, 431_080, 2, 3)
    floor = row["copy_median_s"]
    assert floor > 0
    ours, flowers = row["fedcomp"], row["flower"]
    for step in STEPS:
        assert ours[f"{step}_s"] > 0 and ours[f"{step}_copy_ratio"] == pytest.approx(ours[f"{step}_s"] / floor)
    assert flowers["client_mod_s"] is None and "client_mod_copy_ratio" not in flowers  # (no mod there)
    assert flowers["client_app_s"] > 0 and flowers["aggregate_s"] > 0
    assert len(ours["per_round_s"]) == len(flowers["per_round_s"]) == 3
    # plain FedAvg moves the whole float32 model each way; the wrapper and mod far less
    assert flowers["uplink_bytes"] == flowers["downlink_bytes"] == 4 * 431_080
    assert 0 < ours["uplink_bytes"] < flowers["uplink_bytes"] / 10
    assert 0 < ours["downlink_bytes"] < flowers["downlink_bytes"] / 10
    table = capsys.readouterr().out
    assert "configure" in table and "client mod" in table and "fedcomp" in table and "flower" in table


def test_flowers_task_identity_is_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.supercore.task_identity import TaskIdentity

    names = ("_run_id", "_node_id", "_task_id")
    for i, name in enumerate(names):
        monkeypatch.setattr(TaskIdentity, name, 70 + i, raising=False)  # (a caller's own)
    assert main(["--model", "lenet", "--rounds", "2", "--no-baseline"]) == 0
    assert [getattr(TaskIdentity, name) for name in names] == [70, 71, 72]


def test_the_run_config_reaches_the_wrapper(tmp_path: Path) -> None:
    sizes = {}
    for p in (0.01, 0.2):
        out = tmp_path / f"rounds-{p}.json"
        assert main(["--model", "lenet", "--rounds", "2", "--no-baseline", "-c", f"sbc-p={p}", "--json", str(out)]) == 0
        row = json.loads(out.read_text())
        assert "flower" not in row and row["run_config"] == {"sbc-p": p}
        sizes[p] = row["fedcomp"]["uplink_bytes"]
    assert sizes[0.01] < sizes[0.2] / 3
