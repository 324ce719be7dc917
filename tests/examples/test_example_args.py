"""The example scripts' command lines (issue #18, item 6): a bad option or choice exits 2 with a
message naming it (and the valid choices), before any run starts; a missing data folder exits 2
naming FEDCOMP_DATA_DIR. No data and no training needed: every case stops at argument checking."""

from __future__ import annotations

import importlib
import io
import os
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def _script(name: str, *args: str, data_dir: str | None = None) -> subprocess.CompletedProcess:
    """``python examples/<name>.py ARGS`` as a user runs it (fedcomp importable from this checkout)."""
    env = {k: v for k, v in os.environ.items() if k != "FEDCOMP_DATA_DIR"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if data_dir is not None:
        env["FEDCOMP_DATA_DIR"] = data_dir
    return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def test_methods_table_only_with_an_unknown_label_exits_2_naming_it_and_the_valid_ones(tmp_path: Path) -> None:
    proc = _script("methods_table", "--only", "foo", "--out", str(tmp_path), data_dir="/work/shared/data")
    assert proc.returncode == 2
    assert "--only: unknown method label(s) ['foo']; valid labels: ['dense FedAvg', 'SBC (p = 1 %)'" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "table.md").exists()  # nothing ran, no table written


def test_paper_examples_without_a_data_folder_name_the_env_var() -> None:
    proc = _script("sbc_table2", "--smoke")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: FEDCOMP_DATA_DIR is not set: set it to the folder holding mnist/")
    assert "run config" not in proc.stderr and "Traceback" not in proc.stderr


DATA = os.environ.get("FEDCOMP_DATA_DIR", "")


@pytest.fixture()
def example_main(monkeypatch: pytest.MonkeyPatch):
    """An example's ``main`` called in this process; returns (exit code, stderr). Without
    FEDCOMP_DATA_DIR, so that a broken argument check stops at the data check, never training."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.delenv("FEDCOMP_DATA_DIR", raising=False)

    def run(script: str, *argv: str) -> tuple[int, str]:
        main = importlib.import_module(script).main
        err = io.StringIO()
        with redirect_stderr(err), pytest.raises(SystemExit) as info:
            main(list(argv))
        code = info.value.code
        return (code if isinstance(code, int) else 1), err.getvalue()

    return run


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        ("methods_table", ["--only", "foo", "dense FedAvg", "bar"], "unknown method label(s) ['foo', 'bar']"),
        ("methods_table", ["--only"], "argument --only: expected at least one argument"),
        ("methods_table", ["--rounds", "0"], "argument --rounds: must be >= 1, got '0'"),
        ("methods_table", ["--clients", "two"], "argument --clients: expected an integer >= 1, got 'two'"),
        ("methods_table", ["--timeout", "0"], "argument --timeout: must be in (0, inf), got '0'"),
        ("sbc_table2", ["--seeds", "0"], "argument --seeds: must be >= 1, got '0'"),
        ("sbc_table2", ["--iterations", "-5"], "argument --iterations: must be >= 1, got '-5'"),
        ("threelc_table2", ["--jobs", "0"], "argument --jobs: must be >= 1, got '0'"),
        ("sparsity_grid", ["--ps", "2"], "argument --ps: must be in (0, 1], got '2'"),
        ("sparsity_grid", ["--delays", "0"], "argument --delays: must be >= 1, got '0'"),
        ("compression_gap", ["--rounds", "-1"], "argument --rounds: must be >= 0, got '-1'"),
        ("compression_gap", ["--partition", "skewed"], "argument --partition: invalid choice: 'skewed'"),
        ("compression_gap", ["--inner", "fedprox"], "--inner 'fedprox': unknown strategy 'fedprox' (known: fedavg,"),
        ("compression_gap", ["--inner", "fedavgm:eta=1"], "fedavgm takes server-lr, momentum, got 'eta=1'"),
        ("compression_gap", ["--inner", "fedadam:eta=fast"], "--inner 'fedadam:eta=fast': eta 'fast' is not a number"),
        ("compression_gap", ["--inner", "fedavg:lr=1"], "fedavg takes no parameters, got 'lr=1'"),
    ],
)
def test_bad_options_exit_2_naming_the_option(example_main, script: str, argv: list[str], message: str) -> None:  # type: ignore[no-untyped-def]
    code, err = example_main(script, *argv)
    assert code == 2 and message in err


@pytest.mark.parametrize(
    "script", ["compression_gap", "dp_table", "methods_table", "sbc_table2", "sparsity_grid", "threelc_table2"]
)
def test_help_prints_usage_and_exits_0(example_main, capsys, script: str) -> None:  # type: ignore[no-untyped-def]
    """``--help`` as a newcomer's first call: methods_table's crashed on the "%" of its labels."""
    code, err = example_main(script, "--help")
    out = capsys.readouterr().out
    assert code == 0 and err == ""
    assert out.startswith("usage: ") and "--help" in out


def test_methods_table_rows_use_the_downlink_it_documents(example_main) -> None:  # type: ignore[no-untyped-def]
    """The table is documented with the papers' 3LC downlink (s = 1); the app's own default
    downlink changed to "lattice", and rows that left the key out silently followed it."""
    from fedcomp.app.config import AppConfig

    module = importlib.import_module("methods_table")
    assert "All compressed rows use the 3LC downlink at s = 1" in (module.__doc__ or "")
    for label, extra in module.METHODS.items():
        cfg = AppConfig.from_run_config({**module.base_config(25), **extra}).compression
        if cfg.compress:
            assert (cfg.downlink_codec, cfg.threelc_s.at(1)) == ("3lc", 1.0), label


def test_methods_table_checks_its_choices_before_the_data_folder(example_main) -> None:  # type: ignore[no-untyped-def]
    code, err = example_main("methods_table", "--only", "foo")
    assert code == 2 and "unknown method label(s) ['foo']" in err
    code, err = example_main("methods_table")
    assert code == 2 and "FEDCOMP_DATA_DIR is not set" in err


def test_sparsity_grid_iterations_must_be_a_multiple_of_the_delays(example_main, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    if not (Path(DATA) / "mnist").is_dir():
        pytest.skip("the delay check comes after the data check: needs FEDCOMP_DATA_DIR with mnist/")
    monkeypatch.setenv("FEDCOMP_DATA_DIR", DATA)
    code, err = example_main("sparsity_grid", "--smoke", "--iterations", "3", "--delays", "2")
    assert code == 2 and "--iterations: 3 is not a multiple of --delays [2]" in err


def test_compression_gap_unknown_setting_names_the_known_ones(example_main) -> None:  # type: ignore[no-untyped-def]
    module = importlib.import_module("compression_gap")
    err = io.StringIO()
    with redirect_stderr(err):
        assert module.main(["--only", "nope"]) == 2
    assert "--only: unknown setting(s) ['nope']; known: ['dense'," in err.getvalue()


def test_compression_gap_inner_specs_name_their_cache_files_and_titles(example_main) -> None:  # type: ignore[no-untyped-def]
    module = importlib.import_module("compression_gap")
    assert module.inner_label("fedavgm") == "fedavgm:server-lr=1,momentum=0.9"  # every default spelled out
    assert module.inner_label("fedadam:eta=0.003") == "fedadam:eta=0.003,beta-1=0.9,beta-2=0.99,tau=0.001"
    task = module.Task("default", {"sbc-p": 0.05}, rounds=3)
    # FedAvg keeps the cache key it had before the axis existed; another strategy gets its own.
    assert task.key() != module.Task("default", {"sbc-p": 0.05}, rounds=3, inner=module.inner_label("fedavgm")).key()
    strategy = module.make_inner("fedavgm:server-lr=0.5,momentum=0.7")
    assert (strategy.server_learning_rate, strategy.server_momentum) == (0.5, 0.7)
    # A key added later, at its off value, is left out of the hashed settings (cached runs stay valid).
    off = module.Task("d", {"sbc-p": 0.05, "stale-residual-decay": 1.0}).key_fields()
    assert "stale-residual-decay" not in off["compression"] and "inner" not in off
    on = module.Task("d", {"sbc-p": 0.05, "stale-residual-decay": 0.8}).key_fields()
    assert on["compression"]["stale-residual-decay"] == 0.8


@pytest.mark.parametrize("module", ["fedsim", "simplots"])
def test_the_examples_modules_say_what_to_run_instead(module: str) -> None:
    proc = _script(module, "--help")
    assert proc.returncode == 1 and proc.stdout == ""
    assert f"{module}.py is a module of the example scripts, not a command: run examples/sbc_table2.py" in proc.stderr


def test_compression_gap_cached_only_with_nothing_cached_says_so(example_main, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """It crashed in matplotlib (a plot of 0 columns) when nothing was cached yet."""
    import logging

    module = importlib.import_module("compression_gap")
    monkeypatch.setattr(module, "CACHE", tmp_path)
    err = io.StringIO()
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    try:  # (main quiets Flower's logger for its runs: later tests in this process read its INFO lines)
        with redirect_stderr(err):
            assert module.main(["--cached-only", "--only", "dense,default"]) == 1
    finally:
        flwr_log.setLevel(level)
    assert "nothing cached for dense, default here: run without --cached-only" in err.getvalue()
    assert list(tmp_path.iterdir()) == []


def test_compression_gap_extra_settings_start_from_the_apps_defaults(example_main) -> None:  # type: ignore[no-untyped-def]
    """``--extra 'x={"sbc-p": 0.1}'`` differs from ``default`` in that key alone: it ran the
    library's defaults before (3LC down, the initial model sent), unlike the setting it was meant
    to vary. And a run recorded with a key added later at its off value is found in the cache."""
    module = importlib.import_module("compression_gap")
    from fedcomp.app.config import APP_COMPRESSION_DEFAULTS

    setting = module.extra_setting({"sbc-p": 0.1})
    assert setting == {**APP_COMPRESSION_DEFAULTS, "sbc-p": 0.1}
    assert setting["downlink-codec"] == "lattice" and setting["seeded-initial-model"] is True
    task = module.Task("default", {**APP_COMPRESSION_DEFAULTS, "max-update-norm-factor": 0.0}, rounds=3)
    fields = module._recorded_fields(task)
    recorded = {
        **fields,
        "compression": {**fields["compression"], "max-empty-rounds": 3, "max-update-norm-factor": 0.0},
    }
    assert recorded != fields and module._without_keys_off(recorded) == fields
    other = {**fields, "compression": {**fields["compression"], "max-update-norm-factor": 4.0}}
    assert module._without_keys_off(other) != fields
