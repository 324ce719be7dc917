"""``python -m fedcomp run``: the one command that runs the reference app and can be trusted.

``flwr run . --stream`` is how Flower users run an app, but it exits 0 when the run failed, reports
a misspelled key as ``[code: 15] Invalid run configuration.``, leaves a SuperLink running and
interleaves Flower's INFO lines with the table. This command wraps the same simulation:

1. It reads the run config (``--run-config "key=value ..."``, the same syntax; an unquoted
   string such as ``uplink-codec=deft`` is taken as the string the user meant) and validates it
   against the app's keys (``[tool.flwr.app.config]`` of its ``pyproject.toml``) and
   :class:`fedcomp.app.config.AppConfig` *before anything starts*: an unknown key gets a
   suggestion (``unknown key 'sbc-pp' (did you mean 'sbc-p'?)``), a bad value its key, value
   and allowed range, CUDA asked for on a machine without it its key. Then it exits 2, no
   traceback, with a results.json whose status is "failed" and whose error is that message.
2. It runs the simulation in a sandbox (:func:`fedcomp.testing.flower.run_simulation`: a
   temporary ``FLWR_HOME``, its own SuperLink on a free port), streams a clean table (Flower's
   INFO lines and known warnings filtered, no ANSI colour codes unless the output is a
   terminal; ``--verbose`` shows everything), and stops every process it started, by PID, at
   the end, on Ctrl-C and on SIGTERM.
3. It judges the run by results.json's status, never by flwr's exit code: 0 completed,
   1 failed (or interrupted, timed out), 2 bad configuration or arguments.

Results go to ``--out DIR`` (results.json, final_model.pt and the plots), else to
``<results-dir>/<run-name>`` (``results-dir`` defaults to ``$FEDCOMP_RESULTS_DIR``, else
``./results``; ``run-name`` to a UTC timestamp). The clients' saved state goes there too
(``client-state/``, through ``FEDCOMP_STATE_DIR``), so a run that stopped (Ctrl-C, a crash, a
timeout) continues bit-identically with the same command, ``--out`` its folder and ``resume=true``
added to ``--run-config``; a completed run's client state is removed (a resume of it, for more
rounds, starts its clients as new ones, without their residuals: not bit-identical).

``python -m fedcomp plot RUN_DIR [RUN_DIR ...]`` is :func:`fedcomp.app.plots.main`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from fedcomp.errors import ConfigError
from fedcomp.net.run_config import parse_run_config

#: Exit codes of ``python -m fedcomp run``.
EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
#: Folder of the clients' saved state inside a run's folder (what a resumed run reads).
CLIENT_STATE = "client-state"

#: The reference app: the folder holding this package (its pyproject.toml names the apps).
REFERENCE_APP = Path(__file__).resolve().parent.parent

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
#: Flower's log lines start with their level: ``INFO :      ...``.
_LEVEL = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:")
#: Lines that are noise on every run (quiet mode drops them; ``--verbose`` shows them).
_KNOWN_NOISE = (
    "default simulated SuperNodes changed from 10 to 2",  # we always pass num-supernodes
    "FutureWarning",  # Ray's, about RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO
    "warnings.warn(",  # the source line Python prints under a warning
    "fraction_evaluate is set to 0.0",  # the app evaluates centrally, on purpose
    "Using SuperLink:",
    "Successfully started run",
    "Successfully installed",
    "Manually terminating ClientAppActor",  # Ray, at the end of every simulation
)
#: Lines Ray forwards from its worker processes: ``(pid=25435) ...``, ``(ClientAppActor pid=1747) ...``.
_RAY_WORKER = re.compile(r"^\((\w+ )?pid=\d+\)")
#: The results table (fedcomp.app.results.RunRecorder): its header and its rows.
_TABLE_LINE = re.compile(r"^(round +acc +loss|\s*\d+ +\d\.\d{4} )")


# --- the run config ---------------------------------------------------------------------------------


def app_defaults(app_dir: Path) -> dict[str, Any]:
    """The app's run-config keys and defaults (``[tool.flwr.app.config]``)."""
    path = app_dir / "pyproject.toml"
    try:
        with path.open("rb") as f:
            table = tomllib.load(f)["tool"]["flwr"]["app"]
    except (OSError, tomllib.TOMLDecodeError, KeyError) as err:
        raise ConfigError(f"--app: {app_dir} is not a Flower app ({path}: {type(err).__name__}: {err})") from None
    return dict(table.get("config", {}))


def validate(app_dir: Path, overrides: Mapping[str, Any], check_devices: bool = True) -> Any:
    """Check ``overrides`` as the app will, before anything starts; return the
    :class:`~fedcomp.app.config.AppConfig`. Raise :class:`ConfigError` naming the key.

    Keys the app's pyproject.toml declares beyond AppConfig's are the app's own (test apps):
    they must exist, their values are the app's business.
    """
    from fedcomp.app.config import AppConfig, check_known_keys

    defaults = app_defaults(app_dir)
    check_known_keys(overrides, defaults)
    extra = set(defaults) - AppConfig.keys()
    cfg = AppConfig.from_run_config({**defaults, **overrides}, ignore=extra)
    if check_devices:
        cfg.check_devices()  # a local simulation: the clients run on this machine too
        cfg.check_dataset()  # (else each client fails on it once the simulation is up, 40 s later)
    return cfg


# --- output ------------------------------------------------------------------------------------


class OutputFilter:
    """Turns the flwr CLI's stream into what a user reads: the table, warnings, errors.

    Quiet (default): drops Flower's DEBUG/INFO lines, the known noise (:data:`_KNOWN_NOISE`) and
    the lines Ray forwards from its worker processes;
    of ERROR lines it shows each distinct one once and no tracebacks (neither Flower's nor the
    ones Ray prints for each failing client: results.json and the closing line carry the error;
    ``--verbose`` and the run's log show everything). The table's rows and fedcomp's own lines are
    always shown, also when they arrive amid a traceback. ANSI colour codes are removed unless
    ``color`` (the output is a terminal).
    """

    def __init__(self, out: IO[str], verbose: bool = False, color: bool = False) -> None:
        self.out = out
        self.verbose = verbose
        self.color = color
        self._in_traceback = False
        self._errors_seen: set[str] = set()

    def keep(self, line: str) -> bool:
        """Whether quiet mode shows this (ANSI-free) line."""
        if self.verbose:
            return True
        if line.startswith("[fedcomp]") or _TABLE_LINE.match(line):
            return True
        if _RAY_WORKER.match(line):  # Ray forwarding its workers' own logs (crash dumps of idle workers)
            return False
        level = _LEVEL.match(line)
        if level is None:
            return not self._in_traceback and not any(noise in line for noise in _KNOWN_NOISE)
        self._in_traceback = level.group(1) in ("ERROR", "CRITICAL")
        if level.group(1) in ("DEBUG", "INFO"):
            return False
        if self._in_traceback:
            text = line[level.end() :].strip()
            if text.startswith(("Traceback", "ray::")) or text in self._errors_seen:
                return False
            self._errors_seen.add(text)
        return not any(noise in line for noise in _KNOWN_NOISE)

    def __call__(self, line: str) -> None:
        plain = _ANSI.sub("", line)
        if self.keep(plain.rstrip("\n")):
            self.out.write(line if self.color else plain)
            self.out.flush()


# --- the command --------------------------------------------------------------------------------


def _out_dir(args: argparse.Namespace, overrides: Mapping[str, Any]) -> tuple[Path, str]:
    """Where this run's results go: ``(results root, run name)``. Decided before anything
    starts, so that even a configuration error leaves its results.json where the user looks."""
    from fedcomp.app.results import new_run_name, resolve_results_root

    if args.out:
        out = Path(args.out).expanduser().resolve()
        return out.parent, out.name
    value = overrides.get("results-dir")
    root = resolve_results_root(value if isinstance(value, str) else None)
    name = overrides.get("run-name")
    if isinstance(name, str) and name and name not in (".", "..") and "/" not in name and "\\" not in name:
        return root, name
    return root, new_run_name(root)


def _finish_failed(path: Path, error: str, config: Mapping[str, Any]) -> None:
    """Make sure ``path`` (a results.json) says "failed" with ``error``: write one if the run left
    none, or mark it if the run died before its ServerApp could (status "running")."""
    from fedcomp.app.results import RESULTS_MODE, record_failure

    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        record_failure(config, error, path.parent.parent, path.parent.name, stream=None)
        return
    if data.get("status") == "failed":
        return
    data["status"], data["error"] = "failed", error
    tmp = path.with_name(".results-failed.json")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.chmod(RESULTS_MODE)
    os.replace(tmp, path)


def run(argv: list[str]) -> int:
    """``python -m fedcomp run ...``; returns the exit code."""
    ap = argparse.ArgumentParser(
        prog="python -m fedcomp run",
        description=(
            "Run the fedcomp app as a local Flower simulation: validate the run config first, stream a table "
            "per round, write results.json and plots, stop every process it started. Exit 0 = completed, "
            "1 = failed, 2 = bad configuration."
        ),
    )
    ap.add_argument(
        "--run-config", "-c", action="append", default=[], metavar='"KEY=VALUE ..."',
        help="run-config overrides, as for `flwr run --run-config` (repeatable; unquoted strings are fine)",
    )  # fmt: skip
    ap.add_argument("--nodes", "-n", type=int, default=10, help="simulated SuperNodes (clients), default 10")
    ap.add_argument("--rounds", "-r", type=int, default=None, help="server rounds (= num-server-rounds)")
    ap.add_argument(
        "--out", "-o", default=None, metavar="DIR",
        help="this run's folder (results.json, final_model.pt, plots); default <results-dir>/<run-name>",
    )  # fmt: skip
    ap.add_argument("--verbose", "-v", action="store_true", help="show Flower's own log lines and warnings")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run (default 3600)")
    ap.add_argument("--app", default=str(REFERENCE_APP), metavar="DIR", help="a Flower app folder (default: fedcomp's)")
    args = ap.parse_args(argv)
    app_dir = Path(args.app).expanduser().resolve()
    err = sys.stderr

    overrides: dict[str, Any] = {}
    problem: str | None = None
    try:
        for text in args.run_config:
            overrides.update(parse_run_config(text))
    except ConfigError as exc:
        problem = str(exc)
    if args.rounds is not None:
        overrides["num-server-rounds"] = args.rounds
    root, name = _out_dir(args, overrides)
    results_path = root / name / "results.json"
    if problem is None and args.nodes < 1:
        problem = f"--nodes: must be >= 1 (got {args.nodes})"
    if problem is None and not args.timeout > 0:  # (0 read as "could not start flower-superlink")
        problem = f"--timeout: must be a number of seconds > 0 (got {args.timeout})"
    if problem is None:
        try:
            cfg = validate(app_dir, overrides)
        except ConfigError as exc:
            problem = str(exc)
        else:
            if cfg.clients_per_round > args.nodes:  # the server would wait for clients that never come
                problem = f"clients-per-round: {cfg.clients_per_round} clients per round, but --nodes is {args.nodes}"
    if problem is not None:
        from fedcomp.app.results import record_failure

        record_failure(overrides, f"ConfigError: {problem}", root, name, stream=None)
        print(f"CONFIG ERROR: {problem}\nresults: {results_path} (status failed)", file=err)
        return EXIT_CONFIG

    from fedcomp.app.checkpoint import CHECKPOINT_FILE
    from fedcomp.flower.persist import STATE_DIR_ENV
    from fedcomp.testing.flower import SimulationError, run_simulation

    overrides.update({"results-dir": str(root), "run-name": name})
    # The clients' state goes to the run's folder, not to the simulation's temporary FLWR_HOME:
    # a run that stops can be resumed (resume=true, same --out) bit-identically.
    client_state = root / name / CLIENT_STATE
    show = OutputFilter(sys.stdout, verbose=args.verbose, color=args.verbose and sys.stdout.isatty())
    error: str | None = None
    work: Path | None = None
    # (the table's first line comes only after Flower and Ray have started: seconds of silence)
    print(
        f"[fedcomp] starting a Flower simulation: {args.nodes} client{'' if args.nodes == 1 else 's'}, "
        f"{cfg.num_server_rounds} round{'' if cfg.num_server_rounds == 1 else 's'} "
        "(Flower and Ray take about 10 s to start)",
        flush=True,
    )
    try:
        run_simulation(
            app_dir,
            overrides,
            num_supernodes=args.nodes,
            timeout_s=args.timeout,
            on_output=show,
            env={STATE_DIR_ENV: str(client_state)},
        )
    except SimulationError as exc:
        first = str(exc).split("\n", 1)[0]
        error, work = first, exc.work_dir
        if args.verbose:
            print(str(exc), file=err)
    except KeyboardInterrupt as exc:
        # (a KeyboardInterrupt's str() is empty: "interrupted ()" said nothing)
        error = f"interrupted ({str(exc) or 'Ctrl-C'}); every process of the run was stopped"
    if error is not None:
        _finish_failed(results_path, error, overrides)
    code = _report(results_path, work, err)
    if code == EXIT_OK:  # a run's worth of client snapshots: kept for a run that may resume only
        shutil.rmtree(client_state, ignore_errors=True)
    elif (results_path.parent / CHECKPOINT_FILE).is_file():
        print(
            f"to continue from its last checkpoint: the same command with --out {results_path.parent} "
            "and resume=true in --run-config",
            file=err,
        )
    return code


def _report(results_path: Path, work: Path | None, err: IO[str]) -> int:
    """One closing line from results.json (the only judge of the run)."""
    try:
        data = json.loads(results_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"FAILED: no readable results.json at {results_path} ({exc})", file=err)
        return EXIT_FAILED
    plots = sorted(p.name for p in results_path.parent.glob("*.png"))
    where = f"results: {results_path}" + (f"; plots: {', '.join(plots)}" if plots else "")
    if data.get("status") != "completed":
        logs = f"\nlogs: {work}" if work is not None else ""
        print(f"FAILED: {data.get('error')}\n{where}{logs}", file=err)
        return EXIT_FAILED
    rounds = data.get("rounds") or [{}]
    acc = rounds[-1].get("accuracy")
    acc_text = f", final accuracy {acc:.4f}" if isinstance(acc, float) else ""
    summary = data.get("summary") or {}
    eps, delta = summary.get("dp_epsilon"), summary.get("dp_delta")
    if isinstance(eps, float) and isinstance(delta, float):
        acc_text += f", privacy spent: epsilon {eps:.3g} at delta {delta:.3g}"
    done = len(rounds) - 1
    print(f"OK: {done} round{'' if done == 1 else 's'}{acc_text}\n{where}")
    return EXIT_OK


def plot(argv: list[str]) -> int:
    """``python -m fedcomp plot RUN_DIR ...``: :func:`fedcomp.app.plots.main`, imported only here
    (matplotlib is slow to import and ``run`` does not need it in this process)."""
    try:
        from fedcomp.app import plots
    except ImportError as exc:
        print(f"plot: fedcomp.app.plots is not available ({exc})", file=sys.stderr)
        return EXIT_FAILED
    main: Callable[[list[str]], int] = plots.main
    return main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "run": (run, "run the app as a local simulation (validated config, clean table, exit code you can trust)"),
    "plot": (plot, "plot one or more runs' results (accuracy against bytes, bytes per round)"),
}


#: The package's other command lines, which ``python -m fedcomp`` names (they are modules of
#: their own: ``bench`` imports this one, so this one does not import it).
SIBLINGS: dict[str, str] = {
    "deploy": "a deployment: SuperLink and SuperNodes on this machine (local) or on real hosts",
    "bench": "benchmarks: codecs, server aggregation, rounds, links, DEFT, GradiVeQ",
}


def main(argv: list[str] | None = None) -> int:
    """``python -m fedcomp COMMAND ...``."""
    argv = sys.argv[1:] if argv is None else argv
    usage = (
        "usage: python -m fedcomp {run,plot} [--help] ...\n\n"
        + "\n".join(f"  {name:<6}{text}" for name, (_, text) in COMMANDS.items())
        + "\n\nalso:\n"
        + "\n".join(f"  python -m fedcomp.{name:<7} {text}" for name, text in SIBLINGS.items())
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return EXIT_OK if argv else EXIT_CONFIG
    command = COMMANDS.get(argv[0])
    if command is None:
        hint = (
            f"; did you mean: {shlex.join(['python', '-m', f'fedcomp.{argv[0]}', *argv[1:]])}"
            if argv[0] in SIBLINGS
            else ""
        )
        print(f"{usage}\n\nunknown command {argv[0]!r}{hint}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        return command[0](argv[1:])
    except KeyboardInterrupt:  # before a run started (a started run handles it itself)
        print("interrupted", file=sys.stderr)
        return EXIT_FAILED
