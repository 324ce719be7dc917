"""Drive a real ``flwr run`` simulation from Python (tests, benchmarks) and clean up after it.

:func:`run_simulation` does what a user does (``flwr run <app> --stream``) in a sandbox:

* a temporary ``FLWR_HOME`` whose ``config.toml`` points the default connection at a SuperLink
  this function starts itself (``flower-superlink --simulation``) on free ports, so runs never
  meet each other or a SuperLink the user left running;
* ``FLWR_TELEMETRY_ENABLED=0``, ``FLWR_DISABLE_UPDATE_CHECK=1``,
  ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` (else the SuperLink tries ``uv sync``);
* the run config overrides as a TOML file (``--run-config overrides.toml``: no quoting
  problems), the simulation size as ``--federation-config "num-supernodes=N ..."``;
* a wall-clock bound on the whole thing.

``flwr run --stream`` exits 0 even when the run failed, so success is judged from the app's
``results.json`` (status "completed", every round present), never from the exit code.

Nothing is left behind, also when the caller is interrupted (Ctrl-C, or SIGTERM, which is turned
into :class:`KeyboardInterrupt` while a run is under way in the main thread): the SuperLink, the SuperExec it spawns (its own session), the simulation
process and its Ray processes all inherit a marker variable (``FEDCOMP_SIM_TOKEN``). At the end,
every process of the run -- marked, a descendant of one, or in the session of one -- is sent
SIGTERM and, after a grace period, SIGKILL, by PID. (Ray's daemons must be found through their
session: they overwrite their environment, marker included, when they set their title, and some
ignore SIGTERM.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from fedcomp.app.config import DATA_DIR_ENV
from fedcomp.net.reaper import start_reaper
from fedcomp.net.superlink import (
    TOKEN_ENV,
    FlowerProcessError,
    alive_pids,
    find_marked_pids,
    flwr_bin,
    flwr_env,
    free_port,
    tail,
    terminate,
    wait_healthy,
)

__all__ = ["SimulationError", "alive_pids", "find_marked_pids", "flwr_env", "run_simulation"]

#: The folder holding this ``fedcomp`` package.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]

RESULTS_FILE = "results.json"  # same as fedcomp.app.results.RESULTS_FILE (no torch import here)


class SimulationError(FlowerProcessError):
    """The simulation failed or timed out; the message carries the tail of its logs.

    ``work_dir`` (kept for inspection) and ``token`` (see :func:`find_marked_pids`) are set when
    raised by :func:`run_simulation`.
    """

    work_dir: Path | None = None
    token: str | None = None
    results_path: Path | None = None


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return json.dumps(v) if isinstance(v, str) else str(v)


def _toml(run_config: Mapping[str, Any]) -> str:
    import tomli_w  # a flwr dependency

    return tomli_w.dumps(dict(run_config))


def run_simulation(
    app_dir: str | Path,
    run_config: Mapping[str, Any] | None = None,
    num_supernodes: int = 4,
    timeout_s: float = 300.0,
    *,
    federation_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    work_dir: str | Path | None = None,
    keep_work_dir: bool = False,
    echo: bool = False,
    on_output: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the Flower app in ``app_dir`` as a local simulation; return its parsed results.json.

    Parameters
    ----------
    app_dir : folder with the app's ``pyproject.toml``.
    run_config : run-config overrides (kebab-case keys, as in ``[tool.flwr.app.config]``).
        ``results-dir`` defaults to a folder inside the work dir and ``run-name`` to a fresh
        name; both are how this function finds the results.
    num_supernodes : simulated SuperNodes (= data partitions).
    timeout_s : bound on the whole run, SuperLink start included.
    federation_config : more ``--federation-config`` settings, e.g.
        ``{"client-resources-num-cpus": 1}`` (keys as in ``flwr run --help``).
    env : extra environment variables for the SuperLink (and so the apps).
    work_dir : where FLWR_HOME, logs and (by default) results go; default a new temp folder,
        removed at the end unless ``keep_work_dir`` or the run failed.
    echo : copy the flwr output to stdout as it comes (else only into ``work_dir/flwr-run.log``).
    on_output : called with each line of the flwr output as it comes (in another thread; the
        log gets every line too); overrides ``echo``.

    Returns
    -------
    The parsed results.json, plus ``"_simulation": {"results": path, "work_dir": path,
    "token": marker, "pids": [...]}``: ``pids`` lists every process of the run that was found
    and stopped (see :func:`alive_pids`).

    Raises
    ------
    SimulationError : the run failed, timed out, or left no complete results.json; the message
        has the tail of the flwr output and the SuperLink log.
    """
    app_dir = Path(app_dir).resolve()
    overrides = dict(run_config or {})
    own_work_dir = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="fedcomp-flwr-")) if work_dir is None else Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    flwr_home = work / "flwr-home"
    flwr_home.mkdir(exist_ok=True)
    # Absolute, so the apps (running in the SuperLink's cwd) and this function agree on it.
    overrides["results-dir"] = str(Path(overrides.get("results-dir") or work / "results").expanduser().resolve())
    if not overrides.get("run-name"):
        overrides["run-name"] = f"sim-{uuid.uuid4().hex[:8]}"
    results_path = Path(overrides["results-dir"]) / str(overrides["run-name"]) / RESULTS_FILE
    results_path.unlink(missing_ok=True)  # never mistake an old run's results for this one's
    (work / "run-config.toml").write_text(_toml(overrides))

    token = uuid.uuid4().hex
    run_env = flwr_env(flwr_home)
    run_env.update(env or {})
    if run_env.get(DATA_DIR_ENV):  # named from the caller's folder; the apps run in another one
        run_env[DATA_DIR_ENV] = str(Path(run_env[DATA_DIR_ENV]).expanduser().resolve())
    run_env[TOKEN_ENV] = token
    # The apps import the fedcomp this driver imports: an app whose bundle does not carry fedcomp
    # (tests/flower_app) would otherwise depend on how, and from where, fedcomp was installed.
    run_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), run_env.get("PYTHONPATH")]))

    fed = {"num-supernodes": int(num_supernodes), **(federation_config or {})}
    fed_arg = " ".join(f"{k}={_toml_value(v)}" for k, v in fed.items())
    superlink_log = work / "superlink.log"
    run_log = work / "flwr-run.log"
    procs: list[subprocess.Popen[Any]] = []
    deadline = time.monotonic() + timeout_s
    ok = False
    results: dict[str, Any] | None = None
    if on_output is None and echo:
        on_output = _stdout_line
    with _sigterm_interrupts():
        try:
            # First, a reaper: should this process be SIGKILLed, it stops the run's processes.
            procs.append(start_reaper(token, run_env))
            for attempt in range(3):  # a free port can be taken between probing and binding
                port = free_port()
                link = subprocess.Popen(
                    [
                        flwr_bin("flower-superlink"),
                        "--insecure",
                        "--simulation",
                        "--isolation",
                        "subprocess",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--disable-runtime-dependency-installation",
                        "--log-file",
                        str(superlink_log),
                    ],
                    cwd=app_dir,
                    env=run_env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
                procs.append(link)
                try:
                    wait_healthy(port, link, min(60.0, max(1.0, deadline - time.monotonic())))
                    break
                except FlowerProcessError:
                    if attempt == 2 or link.poll() is None:
                        raise SimulationError(
                            "could not start flower-superlink" + _diagnostics(run_log, superlink_log, results_path)
                        ) from None
            # `flwr run` talks to the SuperLink named as default in $FLWR_HOME/config.toml.
            (flwr_home / "config.toml").write_text(
                f'[superlink]\ndefault = "sim"\n\n[superlink.sim]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
            )

            cmd = [
                flwr_bin("flwr"), "run", str(app_dir), "--stream",
                "--run-config", str(work / "run-config.toml"),
                "--federation-config", fed_arg,
            ]  # fmt: skip
            with open(run_log, "w") as log:
                run = subprocess.Popen(
                    cmd,
                    cwd=app_dir,
                    env=run_env,
                    stdout=subprocess.PIPE if on_output is not None else log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    text=True,
                )
                procs.append(run)
                pump = _pump(run, log, on_output) if on_output is not None else None
                try:
                    run.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    terminate(procs, token)
                    raise SimulationError(
                        f"flwr run did not finish within {timeout_s:.0f}s"
                        + _diagnostics(run_log, superlink_log, results_path)
                    ) from None
                finally:
                    if pump is not None:
                        pump.join(timeout=5)
            if run.returncode != 0:
                raise SimulationError(
                    f"flwr run exited with code {run.returncode}" + _diagnostics(run_log, superlink_log, results_path)
                )
            results = _read_results(results_path)
            rounds = overrides.get("num-server-rounds")
            expected = None if rounds is None else int(rounds) + 1
            if results is None or results.get("status") != "completed":
                status = "no results.json" if results is None else f"status {results.get('status')!r}"
                error = "" if results is None else f" ({results.get('error')})"
                raise SimulationError(
                    f"the run did not complete: {status}{error}" + _diagnostics(run_log, superlink_log, results_path)
                )
            if expected is not None and len(results.get("rounds", [])) != expected:
                raise SimulationError(
                    f"results.json has {len(results.get('rounds', []))} rounds, expected {expected}"
                    + _diagnostics(run_log, superlink_log, results_path)
                )
            results["_simulation"] = {
                "results": str(results_path),
                "work_dir": str(work),
                "token": token,
            }
            ok = True
            return results
        except SimulationError as err:
            err.work_dir, err.token, err.results_path = work, token, results_path
            raise
        finally:
            pids = terminate(procs, token)
            if ok and results is not None:  # ok: results were read and completed
                results["_simulation"]["pids"] = sorted(pids)
            if own_work_dir and ok and not keep_work_dir:
                shutil.rmtree(work, ignore_errors=True)


def _stdout_line(line: str) -> None:
    sys.stdout.write(line)
    sys.stdout.flush()


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While inside: SIGTERM raises KeyboardInterrupt in the main thread, like Ctrl-C, so that the
    caller's ``finally`` stops the run's processes (SIGTERM's default would kill this process
    and leave them running). Elsewhere than in the main thread, signals cannot be handled: no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: let the cleanup run to its end
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _pump(run: subprocess.Popen[str], log: Any, on_output: Callable[[str], None]) -> threading.Thread:
    """Hand the CLI's output to ``on_output`` and copy it to the log (in a thread) until it closes."""

    def copy() -> None:
        assert run.stdout is not None
        for line in run.stdout:
            log.write(line)
            log.flush()
            on_output(line)

    t = threading.Thread(target=copy, daemon=True)
    t.start()
    return t


def _read_results(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _diagnostics(run_log: Path, superlink_log: Path, results_path: Path) -> str:
    return (
        f"\nresults: {results_path}"
        f"\n--- flwr run output ({run_log}), last lines ---\n"
        + _ANSI.sub("", tail(run_log))
        + f"\n--- SuperLink log ({superlink_log}), last lines ---\n"
        + _ANSI.sub("", tail(superlink_log, 30))
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m fedcomp.testing.flower [APP_DIR] -n 10 -c "dataset='mnist'" ...``."""
    import argparse

    from flwr.common.config import parse_config_args

    ap = argparse.ArgumentParser(
        prog="python -m fedcomp.testing.flower",
        description="Run the Flower app as a sandboxed local simulation; check its results.json.",
    )
    ap.add_argument(
        "app_dir", nargs="?", default=os.environ.get("FEDCOMP_APP_DIR", "."),
        help="the app's folder (default: $FEDCOMP_APP_DIR, else the current folder)",
    )  # fmt: skip
    ap.add_argument("-n", "--num-supernodes", type=int, default=10)
    ap.add_argument("-t", "--timeout", type=float, default=600.0, help="seconds (default 600)")
    ap.add_argument(
        "-c", "--run-config", action="append", default=[],
        help="run-config overrides, as for `flwr run --run-config` (repeatable)",
    )  # fmt: skip
    ap.add_argument(
        "--federation-config", action="append", default=[],
        help='more simulation settings, e.g. "client-resources-num-cpus=1" (repeatable)',
    )  # fmt: skip
    ap.add_argument("--work-dir", default=None, help="keep FLWR_HOME and logs here")
    ap.add_argument("-q", "--quiet", action="store_true", help="don't echo the flwr output")
    args = ap.parse_args(argv)
    overrides = parse_config_args(args.run_config) if args.run_config else {}
    # Unlike run_simulation (temp results for tests), keep the results where the app would.
    root = overrides.get("results-dir") or os.environ.get("FEDCOMP_RESULTS_DIR") or "results"
    overrides["results-dir"] = str(Path(root).expanduser().resolve())
    try:
        results = run_simulation(
            args.app_dir,
            overrides,
            num_supernodes=args.num_supernodes,
            timeout_s=args.timeout,
            federation_config=parse_config_args(args.federation_config) or None,
            work_dir=args.work_dir,
            echo=not args.quiet,
        )
    except SimulationError as err:
        print(f"FAILED: {err}", file=sys.stderr)
        return 1
    last = results["rounds"][-1]
    print(
        f"OK: {len(results['rounds']) - 1} rounds, final accuracy {last['accuracy']:.4f}, "
        f"results in {results['_simulation']['results']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
