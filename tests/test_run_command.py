"""``python -m fedcomp run`` (fedcomp.cli), driven as a user drives it: a subprocess.

What it must do (issue 18): refuse a bad run config before anything starts (exit 2, the key named,
no traceback, a results.json saying "failed"), run a good one to a completed results.json with
its plots, fail (non-zero, status "failed") a run in which no client update is ever aggregated,
and leave no process behind -- also when it is stopped with SIGTERM.

Which processes are the run's: the command runs with a marker variable of this test's own; every
process that inherits it, every descendant of one, and every process in the session of one
(Ray's daemons overwrite their environment, marker included, but stay in the SuperLink's session)
is the run's. A thread samples the process table while the command runs; after it exits, none of
those processes may be alive, and none may be new to the table taken before it started.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fedcomp.app.apps import initial_model_of
from fedcomp.app.checkpoint import load_checkpoint
from fedcomp.cli import OutputFilter, parse_run_config
from fedcomp.errors import ConfigError
from fedcomp.net.superlink import is_alive, proc_table

REPO = Path(__file__).resolve().parents[1]
FAULT_APP = REPO / "tests" / "flower_app"
MARK = "FEDCOMP_TEST_RUN_MARK"
HAS_PLOTS = importlib.util.find_spec("fedcomp.app.plots") is not None


# Processes that importing a library may start and wait for, which are not the run's: ctypes'
# ``find_library`` runs ``/sbin/ldconfig -p`` (cuda-pathfinder calls it when ``torch.cuda`` is imported
# in an environment that has cuda-bindings installed; CI's has).
LIBRARY_PROBES = frozenset({"ldconfig"})


class ProcessWatch:
    """Samples the process table every 0.2 s while a command runs; ``ours`` collects every
    process of that command (see the module docstring). ``new_alive()`` after it ended: those
    still alive that were not in the table before it started."""

    def __init__(self, token: str) -> None:
        self.needle = f"{MARK}={token}".encode()
        self.before = set(proc_table())
        self.ours: set[int] = set()
        self.names: dict[int, str] = {}  # pid -> its name (comm), read with the table that saw it
        self.command_pid = 0
        self.cpu_s = 0.0  # CPU seconds the command and the children it waited for used
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> ProcessWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()  # a last look: anything started just before the end

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self.sample()

    def sample(self) -> None:
        names: dict[int, str] = {}
        table = proc_table(names)
        own_sid = os.getsid(0)
        for pid in table:
            if pid in self.ours:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if self.needle in f.read().split(b"\0"):
                        self.ours.add(pid)
            except OSError:
                continue
        while True:
            sids = {table[p][1] for p in self.ours if p in table} - {own_sid}
            more = {
                p for p, (ppid, sid, _) in table.items() if p not in self.ours and (ppid in self.ours or sid in sids)
            }
            if not more:
                break
            self.ours |= more
        for pid in self.ours:
            if pid in names:
                self.names.setdefault(pid, names[pid])

    def new_alive(self, grace_s: float = 2.0) -> list[str]:
        """The run's processes still alive, not in the table before (with their command lines)."""
        deadline = time.monotonic() + grace_s
        while True:
            alive = sorted(p for p in self.ours - self.before if is_alive(p))
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        out = []
        for pid in alive:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            out.append(f"{pid}: {cmd[:150]}")
        return out


def fedcomp_run(
    args: list[str], timeout: float, sigterm_when: Callable[[], bool] | None = None
) -> tuple[subprocess.CompletedProcess[str], ProcessWatch]:
    """Run ``python -m fedcomp run ARGS`` with the marker set; with ``sigterm_when``, send it
    SIGTERM once that returns True (polled every 0.5 s)."""
    token = uuid.uuid4().hex
    env = {**os.environ, MARK: token}
    cmd = [sys.executable, "-m", "fedcomp", "run", *args]
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    with ProcessWatch(token) as watch:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        watch.command_pid = proc.pid
        if sigterm_when is not None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and proc.poll() is None:
                if sigterm_when():
                    proc.send_signal(signal.SIGTERM)
                    break
                time.sleep(0.5)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"`{' '.join(cmd)}` did not exit within {timeout:.0f}s\n{out}\n{err}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    watch.cpu_s = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), watch


def _results(out_dir: Path) -> dict:
    return json.loads((out_dir / "results.json").read_text())


# --- reading the run config (fast) -------------------------------------------------------------------


@pytest.mark.parametrize("sibling", ["deploy", "bench"])
def test_the_other_command_lines_are_named_and_a_sibling_typed_as_a_command_gets_its_spelling(
    sibling: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newcomer reads ``python -m fedcomp.deploy local`` and types ``python -m fedcomp deploy
    local``: exit 2, with the command they meant (its arguments kept)."""
    from fedcomp.cli import main

    assert main(["--help"]) == 0
    assert f"python -m fedcomp.{sibling} " in capsys.readouterr().out
    assert main([sibling, "local", "--run-config", "sbc-p=0.1 lr=0.01"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(
        f"unknown command {sibling!r}; did you mean: python -m fedcomp.{sibling} local --run-config 'sbc-p=0.1 lr=0.01'\n"
    )
    assert main(["deplyo"]) == 2 and capsys.readouterr().err.endswith("unknown command 'deplyo'\n")


@pytest.mark.parametrize("timeout", ["0", "-5", "nan"])
def test_a_timeout_that_is_not_positive_is_a_config_error(
    timeout: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not "could not start flower-superlink" (exit 1) after a SuperLink was tried."""
    from fedcomp.cli import main

    assert main(["run", "--timeout", timeout, "--nodes", "2", "--out", str(tmp_path / "t")]) == 2
    assert f"CONFIG ERROR: --timeout: must be a number of seconds > 0 (got {float(timeout)})" in capsys.readouterr().err
    assert _results(tmp_path / "t")["status"] == "failed"


def test_ctrl_c_is_named_in_the_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt's text is empty: the failure said "interrupted ()"."""
    import fedcomp.testing.flower as simulation
    from fedcomp.cli import main

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(simulation, "run_simulation", interrupted)
    assert main(["run", "--nodes", "2", "--out", str(tmp_path / "t")]) != 0
    assert "interrupted (Ctrl-C); every process of the run was stopped" in _results(tmp_path / "t")["error"]


def test_run_config_values_are_read_as_meant() -> None:
    got = parse_run_config("sbc-p=0.01 local-iters=5 compress=false uplink-codec=deft dataset='mnist' "
                           'data-dir="/a b/c" 3lc-s=steps:1.0@1,1.5@3 run-name=x')  # fmt: skip
    assert got == {
        "sbc-p": 0.01, "local-iters": 5, "compress": False, "uplink-codec": "deft", "dataset": "mnist",
        "data-dir": "/a b/c", "3lc-s": "steps:1.0@1,1.5@3", "run-name": "x",
    }  # fmt: skip
    assert type(got["local-iters"]) is int and type(got["sbc-p"]) is float
    assert parse_run_config("") == {}


@pytest.mark.parametrize(
    "text, message",
    [
        ("sbc-p 0.01", "cannot read 'sbc-p'"),
        ("sbc-p=", "sbc-p: no value"),
        ("rounds=3 sbc-p=0.1 rounds=5", r"rounds: given twice in one --run-config \(3, then 5\)"),
    ],
)
def test_run_config_that_is_not_key_value_pairs_is_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_run_config(text)


# --- what the user sees (fast) -----------------------------------------------------------------------

FLWR_OUTPUT = [  # lines as `flwr run --stream` prints them (from a real run, shortened)
    "Using SuperLink: sim (127.0.0.1:46613)\n",
    "\x1b[92mINFO \x1b[0m:      Starting Flower Simulation\n",
    "\x1b[93mWARNING \x1b[0m:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.\n",
    "Successfully installed fedcomp to /tmp/x/flwr-home/apps/fedcomp.\n",
    "\x1b[93mWARNING \x1b[0m:   fraction_evaluate is set to 0.0. Federated evaluation will be skipped.\n",
    "/x/ray/_private/worker.py:2046: FutureWarning: Tip: In future versions of Ray, ...\n",
    "  warnings.warn(\n",
    "[fedcomp] run r: results in /tmp/r/results.json\n",
    "round     acc    loss        up      down  dense_up  dense_dn    up_x  down_x  time_s\n",
    "    0  0.1818  2.2960        0B        0B        0B        0B       -       -     0.5\n",
    "\x1b[92mINFO \x1b[0m:      [ROUND 1/2]\n",
    "\x1b[93mWARNING \x1b[0m:   fedcomp: rejected the update of node 3 in round 1: bad bytes\n",
    "    1  0.3098  2.2464   41.91kB        0B    3.45MB        0B    82.3       -    24.2\n",
    "\x1b[91mERROR \x1b[0m:     An exception was raised when processing a message by RayBackend\n",
    "\x1b[91mERROR \x1b[0m:     ray::ClientAppActor.run() (pid=1747, ip=192.0.2.2)\n",
    "\x1b[91mERROR \x1b[0m:     Traceback (most recent call last):\n",
    '  File "fault_client.py", line 22, in fault_mod\n',
    "    2  0.3098  2.2464        0B        0B    3.45MB        0B       -       -    25.0\n",  # amid a traceback
    "fault_client.InjectedFailure: fail-train: injected\n",
    "\x1b[91mERROR \x1b[0m:     An exception was raised when processing a message by RayBackend\n",  # again
    "(pid=25435) *** SIGABRT received at time=1795448730 on cpu 0 ***\n",  # an idle Ray worker's crash dump
    "(pid=25435) Fatal Python error: Aborted\n",
    "\x1b[91mERROR \x1b[0m:     ServerApp thread raised an exception\n",
    "Traceback (most recent call last):\n",
    '  File "x.py", line 1, in main\n',
    "[fedcomp] error: NoProgressError: ...\n",
    "(ClientAppActor pid=1747) \x1b[93mWARNING \x1b[0m:   Manually terminating ClientAppActor\n",
]


def test_quiet_output_keeps_the_table_warnings_and_errors_without_colour() -> None:
    out = io.StringIO()
    show = OutputFilter(out)
    for line in FLWR_OUTPUT:
        show(line)
    assert out.getvalue().splitlines() == [
        "[fedcomp] run r: results in /tmp/r/results.json",
        "round     acc    loss        up      down  dense_up  dense_dn    up_x  down_x  time_s",
        "    0  0.1818  2.2960        0B        0B        0B        0B       -       -     0.5",
        "WARNING :   fedcomp: rejected the update of node 3 in round 1: bad bytes",
        "    1  0.3098  2.2464   41.91kB        0B    3.45MB        0B    82.3       -    24.2",
        "ERROR :     An exception was raised when processing a message by RayBackend",
        "    2  0.3098  2.2464        0B        0B    3.45MB        0B       -       -    25.0",
        "ERROR :     ServerApp thread raised an exception",
        "[fedcomp] error: NoProgressError: ...",
    ]


def test_verbose_output_shows_everything_and_colour_only_on_request() -> None:
    out = io.StringIO()
    show = OutputFilter(out, verbose=True)
    for line in FLWR_OUTPUT:
        show(line)
    assert len(out.getvalue().splitlines()) == len(FLWR_OUTPUT) and "\x1b[" not in out.getvalue()
    out = io.StringIO()
    OutputFilter(out, verbose=True, color=True)(FLWR_OUTPUT[1])
    assert out.getvalue() == FLWR_OUTPUT[1]


# --- a bad run config: refused before anything starts (a subprocess each, no Flower) ---------------


def _cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.parametrize(
    "run_config, message",
    [
        ("sbc-pp=0.01", "unknown key 'sbc-pp' (did you mean 'sbc-p'?)"),
        ("uplink-codec=foo", "uplink-codec: unknown uplink method"),  # unquoted: still the string 'foo'
        ("sbc-p=1.5", "sbc-p: value 1.5 is outside (0.0, 0.5]"),
        pytest.param(
            "device='cuda'", "device: 'cuda' was asked for but",
            marks=pytest.mark.skipif(_cuda(), reason="this machine has CUDA: asking for it is no error here"),
        ),
        ("compress=yes", "compress: must be true or false (got 'yes')"),
        ("clients-per-round=3", "clients-per-round: 3 clients per round, but --nodes is 2"),
        # the data, before a simulation whose every client would fail on it (40 s later)
        ("dataset='shakespeare' data-dir='/nonexistent'", "dataset: /nonexistent/tinyshakespeare/input.txt: not found"),
    ],
)  # fmt: skip
def test_bad_config_exits_2_within_10s_naming_the_key(run_config: str, message: str, tmp_path: Path) -> None:
    """Refused before anything starts: no process besides the command, within 10 s of its own CPU
    time (about 3 s here, importing torch for the codec registry; the wall-clock bound is looser,
    60 s, as this 2-core machine is shared by parallel jobs)."""
    out_dir = tmp_path / "run"
    done, watch = fedcomp_run(["--run-config", run_config, "--nodes", "2", "--out", str(out_dir)], timeout=60)
    assert done.returncode == 2, done.stderr
    assert watch.cpu_s < 10.0
    assert message in done.stderr and "Traceback" not in done.stderr + done.stdout
    data = _results(out_dir)
    assert data["status"] == "failed" and message in data["error"]
    assert watch.command_pid in watch.ours  # the watch saw the command (so it would see its children)
    started = {
        f"{p}: {watch.names.get(p, '?')}"
        for p in watch.ours - watch.before - {watch.command_pid}
        if watch.names.get(p) not in LIBRARY_PROBES
    }
    assert not started, f"processes started before the config was refused: {sorted(started)}"


# --- real runs (slow) -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.flower
def test_good_config_completes_with_plots_and_leaves_no_process(tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    args = ["--nodes", "2", "--rounds", "2", "--run-config", "local-iters=2 dataset=digits", "--out", str(out_dir)]
    done, watch = fedcomp_run(args, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    data = _results(out_dir)
    assert data["status"] == "completed" and [r["round"] for r in data["rounds"]] == [0, 1, 2]
    assert all(r["updates_aggregated"] == 2 and r["client_errors"] == {} for r in data["rounds"][1:])
    assert (out_dir / "results.json").stat().st_mode & 0o777 == 0o644
    # The table, quiet: no Flower INFO lines, no colour codes (the output is a pipe, not a terminal).
    lines = done.stdout.splitlines()
    assert "\x1b[" not in done.stdout and not any(line.startswith("INFO") for line in lines)
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["round", "acc"])
    assert [line.split()[0] for line in lines[header + 1 : header + 4]] == ["0", "1", "2"]
    assert lines[-2].startswith("OK: 2 rounds, final accuracy")
    assert len(watch.ours - watch.before) >= 3, "the watch saw too few processes of the run to judge"
    assert watch.new_alive() == [], "processes of the run still alive"
    if not HAS_PLOTS:
        pytest.skip("fedcomp.app.plots absent: the plots are not checked (everything else passed)")
    for name in ("accuracy_vs_bytes.png", "bytes_per_round.png"):
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


@pytest.mark.slow
@pytest.mark.flower
def test_every_client_failing_fails_the_run(tmp_path: Path) -> None:
    """The fault app with ``fail-train = true``: every ClientApp raises on every message."""
    out_dir = tmp_path / "run"
    run_config = "fail-train=true script='01|01|01|01' max-empty-rounds=2 local-iters=1"
    args = ["--app", str(FAULT_APP), "--nodes", "2", "--rounds", "4", "--run-config", run_config, "--out", str(out_dir)]
    done, watch = fedcomp_run(args, timeout=400)
    assert done.returncode == 1, done.stdout + done.stderr
    data = _results(out_dir)
    assert data["status"] == "failed"
    assert "no client update was aggregated in 2 rounds in a row" in data["error"]
    assert "fail-train: this client fails every round" in data["error"]  # the clients' own error text
    assert [r["updates_aggregated"] for r in data["rounds"][1:]] == [0, 0]
    assert "FAILED: NoProgressError" in done.stderr
    assert watch.new_alive() == [], "processes of the run still alive"


@pytest.mark.slow
@pytest.mark.flower
def test_sigterm_stops_every_process_and_marks_the_run_failed_then_it_resumes_bit_identically(tmp_path: Path) -> None:
    """SIGTERM once a round is checkpointed; the clients' state is in the run's folder, and the
    same command with ``resume=true`` continues from the checkpoint (a new simulation: new node
    ids, the clients' residuals from the run's folder, their replicas rebuilt as new nodes') to
    the models an uninterrupted run reaches."""
    out_dir, full_dir = tmp_path / "run", tmp_path / "full"
    config = "local-iters=1 dataset=digits"
    # Far more rounds than the run gets through before the signal lands (a digits round can take
    # a fifth of a second: 20 rounds were all done once before SIGTERM stopped the run); the
    # resumed run below asks only for the rounds the stopped one reached.
    planned = 200
    args = ["--nodes", "2", "--rounds", str(planned), "--run-config", config, "--out", str(out_dir)]
    done, watch = fedcomp_run(args, timeout=300, sigterm_when=lambda: (out_dir / "checkpoint.pt").exists())
    assert done.returncode == 1, done.stdout + done.stderr
    data = _results(out_dir)
    assert data["status"] == "failed" and "interrupted" in data["error"]
    assert len(data["rounds"]) < planned + 1
    assert len(watch.ours - watch.before) >= 3, "the watch saw too few processes of the run to judge"
    assert watch.new_alive() == [], "processes of the run still alive"
    assert f"the same command with --out {out_dir} and resume=true" in done.stderr
    assert len({p.parent.name for p in (out_dir / "client-state").rglob("round-*.state")}) == 2  # both partitions

    checkpointed, recorded = load_checkpoint(out_dir).round, len(data["rounds"]) - 1  # (round 0: the initial model)
    rounds = max(recorded, checkpointed + 1)
    resumed, watch = fedcomp_run(
        ["--nodes", "2", "--rounds", str(rounds), "--run-config", f"{config} resume=true", "--out", str(out_dir)],
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert watch.new_alive() == [], "processes of the resumed run still alive"
    assert not (out_dir / "client-state").exists(), "a completed run keeps its clients' state"
    got = _results(out_dir)["rounds"]
    assert [r["round"] for r in got] == list(range(rounds + 1))
    assert all(r["updates_aggregated"] == 2 for r in got[1:]), [r.get("client_errors") for r in got]
    # The resumed run redoes the rounds after the checkpoint. Those the stopped run had recorded
    # are what an uninterrupted run computes; with none recorded, an uninterrupted run is made.
    if recorded > checkpointed:
        want = data["rounds"]
    else:
        full, _ = fedcomp_run(
            ["--nodes", "2", "--rounds", str(rounds), "--run-config", config, "--out", str(full_dir)], 300
        )
        assert full.returncode == 0, full.stdout + full.stderr
        want = _results(full_dir)["rounds"]
    assert [r["model_digest"] for r in got] == [r["model_digest"] for r in want]


@pytest.mark.slow
@pytest.mark.flower
def test_a_users_app_with_batchnorm_and_a_scalar_parameter_runs_compressed(tmp_path: Path) -> None:
    """Flower's quickstart app as a user writes it (``examples/quickstart/compressed``), its model
    given a BatchNorm layer (an int64 ``num_batches_tracked`` among the arrays) and a learnable
    0-d scalar: a real simulation completes, and the global model counts every batch exactly."""
    data = os.environ.get("FEDCOMP_DATA_DIR", "")
    if not data or not (Path(data) / "mnist").is_dir():
        pytest.skip("FEDCOMP_DATA_DIR does not hold mnist/ (e.g. FEDCOMP_DATA_DIR=/work/shared/data)")
    import shutil

    app = tmp_path / "app"
    shutil.copytree(REPO / "examples" / "quickstart" / "compressed", app, ignore=shutil.ignore_patterns("results"))
    task = app / "mnistquick" / "task.py"
    text = task.read_text()
    for old, new in [
        (
            "        self.conv1 = nn.Conv2d(1, 6, 5)\n",
            "        self.conv1 = nn.Conv2d(1, 6, 5)\n        self.bn1 = nn.BatchNorm2d(6)\n",
        ),
        (
            "        self.fc3 = nn.Linear(84, 10)\n",
            "        self.fc3 = nn.Linear(84, 10)\n        self.scale = nn.Parameter(torch.tensor(1.0))\n",
        ),
        ("x = self.pool(F.relu(self.conv1(x)))", "x = self.pool(F.relu(self.bn1(self.conv1(x))))"),
        ("        return self.fc3(x)\n", "        return self.fc3(x) * self.scale\n"),
    ]:
        assert old in text, f"examples/quickstart changed: {old!r} not found in task.py"
        text = text.replace(old, new)
    task.write_text(text)
    out_dir = tmp_path / "run"
    done, watch = fedcomp_run(["--app", str(app), "--nodes", "2", "--rounds", "2", "--out", str(out_dir)], timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _results(out_dir)["status"] == "completed"
    model = torch.load(out_dir / "final_model.pt", weights_only=True)
    assert model["scale"].shape == () and float(model["scale"]) != 1.0
    # two rounds of one epoch over each client's half of MNIST's 60,000 images, 32 to a batch
    assert float(model["bn1.num_batches_tracked"]) == 2 * -(-30_000 // 32)
    assert watch.new_alive() == [], "processes of the run still alive"


@pytest.mark.slow
@pytest.mark.flower
def test_the_shakespeare_char_lstm_runs_compressed(tmp_path: Path) -> None:
    """``dataset = "shakespeare"``: the CharLSTM (LSTM weights and biases, an embedding) through a
    real simulation, two rounds: completed, every update aggregated, the uplink compressed, the
    test loss below the uniform guess's ln(256) = 5.55."""
    data = os.environ.get("FEDCOMP_DATA_DIR", "")
    if not data or not (Path(data) / "tinyshakespeare" / "input.txt").is_file():
        pytest.skip(
            "FEDCOMP_DATA_DIR does not hold tinyshakespeare/input.txt (e.g. FEDCOMP_DATA_DIR=/work/shared/data)"
        )
    out_dir = tmp_path / "run"
    config = "dataset='shakespeare' local-iters=3 lr=0.01"
    done, watch = fedcomp_run(
        ["--nodes", "2", "--rounds", "2", "--run-config", config, "--out", str(out_dir)], timeout=400
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data_ = _results(out_dir)
    assert data_["status"] == "completed"
    last = data_["rounds"][-1]
    assert last["updates_aggregated"] == 2 and last["uplink_compression"] > 10
    assert last["dense_uplink_bytes"] == 2 * 4 * 543_104  # two clients' CharLSTM, as dense float32
    assert last["loss"] < 5.5
    assert watch.new_alive() == [], "processes of the run still alive"


@pytest.mark.slow
@pytest.mark.flower
def test_one_seed_samples_the_same_partitions_in_every_run_compressed_or_not(tmp_path: Path) -> None:
    """``clients-per-round``: two runs with the same seed train the same partitions each round and
    end on the same models, and the dense baseline samples those partitions too (a simulation's
    node ids are new in every run; before, only round 1's sample was the same)."""
    runs = {}
    for name, extra in (("a", ""), ("b", ""), ("dense", " compress=false")):
        out_dir = tmp_path / name
        config = f"clients-per-round=2 local-iters=1 dataset=digits{extra}"
        done, watch = fedcomp_run(["--nodes", "5", "--rounds", "4", "--run-config", config, "--out", str(out_dir)], 400)
        assert done.returncode == 0, done.stdout + done.stderr
        assert watch.new_alive() == [], "processes of the run still alive"
        data = _results(out_dir)
        parts = data["summary"]["node_partitions"]
        assert sorted(parts.values()) == list(range(5))
        sampled = [sorted(parts[c] for c in r["clients"]["ids"]) for r in data["rounds"][1:]]
        assert all(len(s) == 2 for s in sampled)
        runs[name] = (sampled, [r["model_digest"] for r in data["rounds"]])
    assert runs["a"] == runs["b"]
    assert runs["dense"][0] == runs["a"][0]
    assert len({tuple(s) for s in runs["a"][0]}) > 1  # the rounds do sample differently


@pytest.mark.slow
@pytest.mark.flower
def test_one_seed_gives_one_deft_run(tmp_path: Path) -> None:
    """DEFT with every node training: two runs with the same seed end on the same models. DEFT
    ranks its clients, and the reference app lists them in partition order; in node-id order a
    simulation's new ids gave the partitions other bins in each run (4 nodes: 23 chances in 24)."""
    runs = []
    for name in ("a", "b"):
        out_dir = tmp_path / name
        config = "uplink-codec=deft local-iters=1 dataset=digits"
        done, watch = fedcomp_run(["--nodes", "4", "--rounds", "2", "--run-config", config, "--out", str(out_dir)], 400)
        assert done.returncode == 0, done.stdout + done.stderr
        assert watch.new_alive() == [], "processes of the run still alive"
        data = _results(out_dir)
        assert sorted(data["summary"]["node_partitions"].values()) == list(range(4))
        assert all(r["updates_aggregated"] == 4 for r in data["rounds"][1:])
        runs.append([r["model_digest"] for r in data["rounds"]])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == 3  # the model moved every round


@pytest.mark.slow
@pytest.mark.flower
@pytest.mark.parametrize("compress", ["true", "false"])
def test_central_dp_bounds_the_servers_step_by_the_clipping_norm(compress: str, tmp_path: Path) -> None:
    """``dp-clipping-norm`` (client-side clipping, noise 0, two clients, one round): the server's
    step is the mean of two updates each clipped to the norm, so at most the norm; compressed, the
    mod clips what it sends (residual included), and the dense baseline clips in the ClientApp."""
    out_dir = tmp_path / "run"
    config = f"local-iters=5 dp-clipping-norm=0.05 compress={compress}"
    done, _ = fedcomp_run(["--nodes", "2", "--rounds", "1", "--run-config", config, "--out", str(out_dir)], timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _results(out_dir)["rounds"][-1]["updates_aggregated"] == 2
    final = torch.load(out_dir / "final_model.pt")
    initial = initial_model_of(0, "digits").state_dict()
    step = math.sqrt(math.fsum(float((final[k].double() - initial[k].double()).pow(2).sum()) for k in initial))
    # Unclipped, the same round moves the model by 1.51 (measured): the clip binds, 30x.
    assert 0.005 < step <= 0.05 * (1 + 1e-5)


@pytest.mark.slow
@pytest.mark.flower
def test_a_noisy_dp_run_reports_the_privacy_it_spent_round_by_round(tmp_path: Path) -> None:
    """``dp-noise-multiplier`` > 0: results.json holds each round's epsilon at ``dp-delta``, as
    Flower's RDP accountant counts the same releases (3 of 3 clients, noise 1), the closing line
    says what the run spent, and a resumed run keeps counting (the checkpoint holds the count)."""
    from flwr.serverapp import RdpAccountant
    from flwr.supercore.privacy_accounting import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )

    out_dir = tmp_path / "run"
    config = "local-iters=2 dp-clipping-norm=0.5 dp-noise-multiplier=1.0 dp-delta=1e-6"
    done, _ = fedcomp_run(["--nodes", "3", "--rounds", "2", "--run-config", config, "--out", str(out_dir)], timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    accountant = RdpAccountant(
        PrivacyConfig(1e-6, 3, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION)
    )
    expected = []
    for _ in range(4):
        accountant.compose(GaussianPrivacyEvent(noise_multiplier=1.0, sample_size=3, population_size=3))
        expected.append(accountant.get_epsilon(1e-6))
    data = _results(out_dir)
    assert [r["dp_epsilon"] for r in data["rounds"][1:]] == pytest.approx(expected[:2], rel=1e-9)
    assert data["summary"]["dp_epsilon"] == pytest.approx(expected[1]) and data["summary"]["dp_delta"] == 1e-6
    assert f"privacy spent: epsilon {expected[1]:.3g} at delta 1e-06" in done.stdout
    # Resumed from its checkpoint for two more rounds, the run counts on from its two releases.
    more = ["--nodes", "3", "--rounds", "4", "--run-config", f"{config} resume=true", "--out", str(out_dir)]
    resumed, _ = fedcomp_run(more, timeout=400)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [r["dp_epsilon"] for r in _results(out_dir)["rounds"][1:]] == pytest.approx(expected, rel=1e-9)
