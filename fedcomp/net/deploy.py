"""Run the app on Flower's Deployment Engine: real SuperLink, real SuperNodes, ``flwr run``.

    python -m fedcomp.deploy local --nodes 3 --rounds 5 --links "10,10,20;100,100,5"
    python -m fedcomp.deploy local --tls --auth --nodes 3 --rounds 5
    python -m fedcomp.deploy supernode --superlink HOST:9092 --root-certificates ca.pem \\
        [--auth-key node.key] --partition-id 0 --num-partitions 3 --uplink-mbps 10 --downlink-mbps 100
    python -m fedcomp.deploy run --superlink HOST:9092 --root-certificates ca.pem [--rounds R]

``local`` starts one ``flower-superlink --insecure`` and N ``flower-supernode --insecure`` on
127.0.0.1 (free ports; with ``--netns`` each in a network namespace of its own behind a
``tc``-shaped veth pair instead, see :mod:`fedcomp.net.netns`; each SuperNode with its own ``FLWR_HOME`` and ``--node-config`` holding
``partition-id``, ``num-partitions`` and its link ``uplink-mbps``, ``downlink-mbps``,
``latency-ms``), waits until the SuperLink lists all N nodes online, runs the app with
``flwr run <app> <connection> --stream`` (a connection entry in ``$FLWR_HOME/config.toml``:
``address``, ``insecure = true``), checks that ``results.json`` says ``completed`` (the CLI's exit
code does not), and stops every process it started: SIGTERM to each process, its process group
and session, then SIGKILL after a grace period, by PID (the machinery of
:mod:`fedcomp.testing.flower`). A node config that is missing a link value or holds a
nonsensical one stops it before anything starts, with a message naming the node and the key;
so does a run config the app would refuse (``python -m fedcomp.deploy`` hands the app's own check
to :func:`main`), with exit code 2.

``local --tls`` makes a throwaway CA and a server certificate for 127.0.0.1/localhost in
``<work-dir>/tls`` (:mod:`fedcomp.net.tls`), serves the SuperLink's one port over TLS
(``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile``), starts the SuperNodes with
``--root-certificates ca.pem`` and gives ``flwr`` a connection with ``root-certificates``.
``--auth`` adds SuperNode authentication: the SuperLink runs with ``--enable-supernode-auth``, one
ECDSA P-384 key pair per node is made, each public key is registered (``flwr supernode register
node-<i>.pub``) before the nodes start, and SuperNode i gets ``--auth-supernode-private-key
node-<i>.key``. A node whose key is not registered (or that has none, or speaks plain HTTP) is
refused when it connects; :func:`refusal_reason` reads why from its log.

``supernode`` starts one SuperNode against a SuperLink on another host (TLS unless the SuperLink
is on loopback) with a validated node config, and gives up with a clear message when the
SuperLink cannot be reached within ``--max-wait-time``. ``run`` submits the app to such a
SuperLink and streams its logs.

Links: ``--links "UP,DOWN,LATENCY;..."`` (Mbit/s, Mbit/s, ms) is cycled over the nodes (see
:mod:`fedcomp.net.links`); ``--node-config-file nodes.toml`` sets any node-config key per node::

    [default]                 # every node (below the per-node values)
    latency-ms = 20.0
    [[node]]                  # node 0 (partition-id 0 unless given)
    uplink-mbps = 10.0
    downlink-mbps = 100.0
    [[node]]                  # node 1
    uplink-mbps = 100.0
    downlink-mbps = 100.0

Precedence: ``[[node]]`` > ``[default]`` > ``--links`` > ``partition-id = index``,
``num-partitions = number of nodes``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from fedcomp.errors import ConfigError
from fedcomp.net.links import LinkProfile, parse_link_profiles
from fedcomp.net.netns import SUPERLINK_PORT, SUPERNODE_PORT, NetnsLab, NetnsUnavailable
from fedcomp.net.reaper import start_reaper
from fedcomp.net.run_config import parse_run_config
from fedcomp.net.superlink import (
    TOKEN_ENV,
    FlowerProcessError,
    alive_pids,
    flwr_bin,
    flwr_env,
    proc_table,
    terminate,
)
from fedcomp.net.tls import DEFAULT_HOSTS, TlsMaterial, make_tls_material

__all__ = [
    "DEFAULT_LINKS",
    "DeployError",
    "LocalDeployment",
    "NodeSpec",
    "deploy_local",
    "node_specs",
    "run_app",
]

RESULTS_FILE = "results.json"
#: Link of every node when neither --links nor a node-config file names one: 100/100 Mbit/s, 10 ms.
DEFAULT_LINKS = "100,100,10"
CONNECTION = "fedcomp-local"
_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
_LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class DeployError(RuntimeError):
    """The deployment failed (a process did not start, the run failed or timed out).

    ``results``: the run's results.json when it left one (its ``error`` says why it failed).
    """

    def __init__(self, message: str, results: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.results = results

    @property
    def config_error(self) -> bool:
        """The app refused its run config (a ``ConfigError`` raised in the ServerApp)."""
        error = (self.results or {}).get("error") or ""
        return isinstance(error, str) and error.startswith("ConfigError")


# --- node configs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSpec:
    """One SuperNode: its index and its validated node config."""

    index: int
    config: dict[str, Any]

    @property
    def link(self) -> LinkProfile:
        link = LinkProfile.from_node_config(self.config, self.name)
        if link is None:
            raise ConfigError(f"{self.name}: uplink-mbps: missing")
        return link

    @property
    def name(self) -> str:
        return f"node {self.index} (partition-id {self.config.get('partition-id')})"

    def node_config_arg(self) -> str:
        """The ``--node-config`` string: ``key=value`` pairs, TOML values."""
        return " ".join(f"{k}={_toml_scalar(v)}" for k, v in self.config.items())


def _toml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)  # 10.0, never 10 (stays a float on the other side)
    if isinstance(v, int):
        return str(v)
    return json.dumps(v)


def _check_node(spec: NodeSpec) -> None:
    where, cfg = spec.name, spec.config
    for key, value in cfg.items():
        if not _KEY.match(key):
            raise ConfigError(f"node {spec.index}: {key!r}: not a valid node-config key (letters, digits, '-', '_')")
        if isinstance(value, str):
            if any(c in value for c in "\"'\\\n\r"):
                raise ConfigError(f"{where}: {key}: string values may not hold quotes, backslashes or newlines")
        elif not isinstance(value, bool | int | float):
            raise ConfigError(f"{where}: {key}: must be a number, a string or true/false (got {value!r})")
    for key in ("partition-id", "num-partitions"):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{where}: {key}: must be an integer (got {v!r})")
    if cfg["num-partitions"] < 1:
        raise ConfigError(f"{where}: num-partitions: must be >= 1 (got {cfg['num-partitions']})")
    if not 0 <= cfg["partition-id"] < cfg["num-partitions"]:
        raise ConfigError(
            f"{where}: partition-id: must be in [0, num-partitions = {cfg['num-partitions']}) "
            f"(got {cfg['partition-id']})"
        )
    if LinkProfile.from_node_config(cfg, where) is None:
        raise ConfigError(f"{where}: uplink-mbps: missing (every node needs uplink-mbps and downlink-mbps)")


def node_specs(
    nodes: int | None = None,
    links: str | Sequence[LinkProfile] | None = None,
    node_config_file: str | Path | Mapping[str, Any] | None = None,
) -> list[NodeSpec]:
    """Build and validate every SuperNode's node config; raise ConfigError naming node and key.

    ``links``: profiles cycled over the nodes (default :data:`DEFAULT_LINKS` when the file names
    no link). ``node_config_file``: a TOML file (or its parsed dict) with an optional
    ``[default]`` table and ``[[node]]`` tables, one per node.
    """
    file: Mapping[str, Any] = {}
    if isinstance(node_config_file, Mapping):
        file = node_config_file
    elif node_config_file is not None:
        path = Path(node_config_file)
        try:
            file = tomllib.loads(path.read_text())
        except OSError as err:
            raise ConfigError(f"--node-config-file: cannot read {path}: {err.strerror}") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"--node-config-file: {path} is not valid TOML: {err}") from None
    unknown = set(file) - {"default", "node"}
    if unknown:
        raise ConfigError(f"--node-config-file: unknown table(s) {sorted(unknown)} (expected [default] and [[node]])")
    default = file.get("default", {})
    per_node = file.get("node", [])
    if (
        not isinstance(default, Mapping)
        or not isinstance(per_node, list)
        or not all(isinstance(x, Mapping) for x in per_node)
    ):
        raise ConfigError("--node-config-file: expected a [default] table and [[node]] tables")
    if nodes is None:
        if not per_node:
            raise ConfigError("--nodes: give the number of SuperNodes (or [[node]] tables in --node-config-file)")
        nodes = len(per_node)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ConfigError(f"--nodes: must be an integer >= 1 (got {nodes!r})")
    if per_node and len(per_node) != nodes:
        raise ConfigError(f"--nodes {nodes} but --node-config-file has {len(per_node)} [[node]] tables")
    if isinstance(links, str) or links is None:
        profiles = parse_link_profiles(links if links is not None else "", key="--links")
    else:
        profiles = list(links)
    if not profiles and not any("uplink-mbps" in t for t in (default, *per_node)):
        profiles = parse_link_profiles(DEFAULT_LINKS)
    specs = []
    for i in range(nodes):
        cfg: dict[str, Any] = {"partition-id": i, "num-partitions": nodes}
        if profiles:
            cfg.update(profiles[i % len(profiles)].to_node_config())
        cfg.update(default)
        cfg.update(per_node[i] if per_node else {})
        spec = NodeSpec(i, cfg)
        _check_node(spec)
        specs.append(spec)
    seen: dict[int, int] = {}
    for s in specs:
        pid = s.config["partition-id"]
        if pid in seen:
            raise ConfigError(
                f"{s.name}: partition-id: {pid} is already node {seen[pid]}'s (each node needs its own partition)"
            )
        seen[pid] = s.index
    return specs


# --- processes ---------------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (all bound at once, so never the same twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"({path}: no log)"
    return "\n".join(_ANSI.sub("", line) for line in lines[-n:])


def _connection_toml(name: str, address: str, *, insecure: bool, root_certificates: str | None) -> str:
    lines = [
        "[superlink]",
        f"default = {json.dumps(name)}",
        "",
        f"[superlink.{json.dumps(name)}]",
        f"address = {json.dumps(address)}",
    ]
    if insecure:
        lines.append("insecure = true")
    if root_certificates:
        lines.append(f"root-certificates = {json.dumps(str(Path(root_certificates).resolve()))}")
    return "\n".join(lines) + "\n"


def _read_results(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    return host in _LOOPBACK


def _with_run_defaults(run_config: Mapping[str, Any], rounds: int | None, results_dir: Path | None) -> dict[str, Any]:
    cfg = dict(run_config)
    if rounds is not None:
        cfg["num-server-rounds"] = int(rounds)
    root = (
        cfg.get("results-dir")
        or (str(results_dir) if results_dir else "")
        or os.environ.get("FEDCOMP_RESULTS_DIR")
        or "results"
    )
    cfg["results-dir"] = str(Path(str(root)).expanduser().resolve())  # absolute: the ServerApp runs elsewhere
    if not cfg.get("run-name"):
        cfg["run-name"] = "deploy-" + time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4]
    return cfg


def run_app(
    app_dir: str | Path,
    address: str,
    run_config: Mapping[str, Any],
    *,
    flwr_home: str | Path,
    timeout_s: float,
    insecure: bool = False,
    root_certificates: str | None = None,
    env: Mapping[str, str] | None = None,
    log_path: str | Path | None = None,
    echo: bool = False,
    results_path: str | Path | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    procs: list[subprocess.Popen[Any]] | None = None,
    prefix: Sequence[str] = (),
) -> dict[str, Any] | None:
    """``flwr run <app> <connection> --stream`` against the SuperLink at ``address``.

    Writes the connection into ``flwr_home/config.toml`` and the run config into a TOML file
    next to it, and waits at most ``timeout_s``. With ``results_path`` (a SuperLink whose
    results folder this machine sees) the run is judged by its ``status``, and ``on_round`` is
    called with each round entry as it appears. Returns the parsed results (None without
    ``results_path``); raises :class:`DeployError` when the CLI fails (e.g. the SuperLink is
    unreachable), times out, or the results do not say ``completed``. ``prefix``: run the CLI
    through it (e.g. ``ip netns exec NS``).
    """
    app_dir = Path(app_dir).resolve()
    home = Path(flwr_home)
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        _connection_toml(CONNECTION, address, insecure=insecure, root_certificates=root_certificates)
    )
    import tomli_w  # a flwr dependency

    rc_file = home / "run-config.toml"
    rc_file.write_text(tomli_w.dumps(dict(run_config)))
    log_path = Path(log_path) if log_path else home / "flwr-run.log"
    results = Path(results_path) if results_path else None
    resuming = run_config.get("resume") is True
    kept_stamp = _stamp(results) if results is not None and resuming else None
    if results is not None and not resuming:
        results.unlink(missing_ok=True)  # never mistake an old run's results for this one's
    run_env = flwr_env(home, {**os.environ, **(env or {})})
    own = procs is None
    if own or TOKEN_ENV not in run_env:
        run_env[TOKEN_ENV] = uuid.uuid4().hex  # marks the CLI's processes for the cleanup
    cmd = [*prefix, flwr_bin("flwr"), "run", str(app_dir), CONNECTION, "--stream", "--run-config", str(rc_file)]
    deadline = time.monotonic() + timeout_s
    procs = [] if procs is None else procs
    if own:  # (`deploy run`: should this process be SIGKILLed, the reaper stops `flwr run`)
        procs.append(start_reaper(run_env[TOKEN_ENV], run_env))
    seen_rounds = 0
    with _appended_log(log_path, cmd) as log:
        run = subprocess.Popen(
            cmd, cwd=app_dir, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, text=True, errors="replace",
        )  # fmt: skip
        procs.append(run)
        pump = _pump(run, log, echo)
        try:
            while run.poll() is None:
                if time.monotonic() > deadline:
                    raise DeployError(
                        f"flwr run did not finish within {timeout_s:.0f}s\n--- flwr run ---\n{tail(log_path)}"
                    )
                if results is not None and on_round is not None:
                    seen_rounds = _fire_rounds(results, seen_rounds, on_round)
                time.sleep(0.5)
        finally:
            if own:
                terminate(procs, run_env[TOKEN_ENV], grace_s=3.0)
            pump.join(timeout=5)
    if results is not None and on_round is not None:
        _fire_rounds(results, seen_rounds, on_round)
    out = tail(log_path)
    if run.returncode != 0:
        hint = ""
        if "unavailable" in out.lower() or "connect" in out.lower():
            hint = f" (the SuperLink at {address} could not be reached)"
        raise DeployError(f"flwr run exited with code {run.returncode}{hint}\n--- flwr run ---\n{out}")
    if results is None:
        # No results.json on this host (a remote SuperLink's): ask the SuperLink how the run
        # ended, since ``flwr run --stream`` exits 0 whether it completed or failed.
        status = _run_status(log_path, home, run_env, prefix)
        if status.split(" ", 1)[0] != _COMPLETED:
            raise DeployError(f"the run did not complete: the SuperLink says {status}\n--- flwr run ---\n{out}")
        return None
    if kept_stamp is not None and _stamp(results) == kept_stamp:
        # A resume the ServerApp refused before it rewrote results.json: the crashed run's file
        # is kept as it was (it used to be deleted first), and the refusal is in the log.
        raise DeployError(
            f"the resume did not start: {results} was not rewritten (the crashed run's, kept as it was); "
            f"the ServerApp's error is in the log\n--- flwr run ---\n{out}"
        )
    data = _read_results(results)
    if data is None:
        raise DeployError(f"the run left no readable {results}\n--- flwr run ---\n{out}")
    if data.get("status") != "completed":
        raise DeployError(
            f"the run did not complete: status {data.get('status')!r} ({data.get('error')})\n--- flwr run ---\n{out}",
            results=data,
        )
    return data


#: What :func:`_appended_log` writes before each start's lines.
_LOG_START = "=== fedcomp "


def _this_start(log: Path) -> str:
    """The lines of a log (:func:`_appended_log`) its latest start wrote (raises OSError)."""
    return log.read_text(errors="replace").rsplit(_LOG_START, 1)[-1]


def _appended_log(path: Path, cmd: Sequence[str]) -> IO[str]:
    """``path`` opened for appending, after a line that says when and what started: a resumed
    run's processes write after the crashed run's lines (they were overwritten)."""
    out = open(path, "a")  # noqa: SIM115 (the caller's with-block closes it)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    gap = "\n" if out.tell() else ""
    out.write(f"{gap}{_LOG_START}{stamp}: {' '.join(map(str, cmd))}\n")
    out.flush()
    return out


#: ``flwr ls``'s status of a run that completed.
_COMPLETED = "finished:completed"


def _run_status(log_path: Path, home: Path, env: Mapping[str, str], prefix: Sequence[str] = ()) -> str:
    """The status ``flwr ls`` gives the run this start of ``flwr run`` began (its id read from
    its log lines), or a sentence saying why there is none."""
    try:
        text = _this_start(log_path)
    except OSError as exc:
        return f"nothing readable ({exc})"
    found = re.search(r"Successfully started run (\d+)", _ANSI.sub("", text))
    if found is None:
        return "nothing: flwr run started no run"
    cmd = [*prefix, flwr_bin("flwr"), "ls", CONNECTION, "--run-id", found[1], "--format", "json"]
    try:
        out = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=60, cwd=home)
        data = json.loads(out.stdout[out.stdout.find("{") :])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, OSError) as exc:
        return f"nothing readable for run {found[1]} (flwr ls: {type(exc).__name__})"
    runs = data.get("runs") or []
    if not runs:
        return f"nothing for run {found[1]} ({data.get('error-message', 'flwr ls listed no run')})"
    return f"{runs[0].get('status')}" + (f" ({runs[0]['status-details']})" if runs[0].get("status-details") else "")


def _stamp(path: Path) -> tuple[int, int] | None:
    """The file's modification time and size (None when absent): whether a run rewrote it."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _fire_rounds(results: Path, seen: int, on_round: Callable[[dict[str, Any]], None]) -> int:
    data = _read_results(results)
    rounds = (data or {}).get("rounds", [])
    for entry in rounds[seen:]:
        on_round(entry)
    return max(seen, len(rounds))


def _pump(proc: subprocess.Popen[str], log: Any, echo: bool) -> threading.Thread:
    def copy() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()

    t = threading.Thread(target=copy, daemon=True)
    t.start()
    return t


@dataclass
class LocalDeployment:
    """One SuperLink and N SuperNodes on 127.0.0.1: insecure (loopback only), or over TLS.

    Use as a context manager (``stop()`` on exit, whatever happened)::

        with LocalDeployment(app_dir, node_specs(3), work_dir) as dep:
            dep.start(timeout_s=60)
            results = dep.run({"num-server-rounds": 2}, timeout_s=120)

    ``tls`` (see :func:`fedcomp.net.tls.make_tls_material`): the SuperLink serves its one HTTP
    port (Fleet, Control and Runtime APIs) over TLS with ``tls.server_cert``; the SuperNodes and
    the ``flwr`` CLI verify it against ``tls.ca_cert`` (``--root-certificates``, and
    ``root-certificates`` in the connection). ``auth`` (needs ``tls``, as Flower does): the
    SuperLink runs with ``--enable-supernode-auth``; before any SuperNode starts, each node's
    public key ``tls.nodes[i].public`` is registered with ``flwr supernode register`` (node ids in
    :attr:`registered`), and SuperNode i starts with ``--auth-supernode-private-key
    tls.nodes[i].private``. A SuperNode whose key is not registered is refused by the SuperLink
    when it activates (Flower's ApiError 2004; 2001 for one with no key at all).
    """

    app_dir: Path
    nodes: list[NodeSpec]
    work_dir: Path
    echo: bool = False
    #: How long a SuperNode keeps trying to reach the SuperLink before it exits (--max-wait-time).
    node_max_wait_s: float = 30.0
    env: Mapping[str, str] = field(default_factory=dict)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    port: int | None = None
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    node_procs: dict[int, subprocess.Popen[Any]] = field(default_factory=dict)
    stopped_pids: list[int] = field(default_factory=list)
    #: Real shaped links (fedcomp.net.netns): every process in its own network namespace.
    lab: NetnsLab | None = None
    #: TLS material (CA, server certificate, node keys); None = insecure (loopback only).
    tls: TlsMaterial | None = None
    #: SuperNode authentication (needs ``tls`` with one key pair per node).
    auth: bool = False
    #: Node index -> the node id ``flwr supernode register`` gave its public key (``auth`` only).
    registered: dict[int, int] = field(default_factory=dict)
    #: The process that stops the deployment should this one die without :meth:`stop`.
    reaper: subprocess.Popen[Any] | None = None

    def __post_init__(self) -> None:
        self.app_dir = Path(self.app_dir).resolve()
        self.work_dir = Path(self.work_dir).resolve()
        if not (self.app_dir / "pyproject.toml").is_file():
            raise ConfigError(f"app: {self.app_dir} has no pyproject.toml (run from the app's folder or pass --app)")
        if self.auth and self.tls is None:
            raise ConfigError(
                "--auth: SuperNode authentication needs --tls (Flower refuses it on an insecure SuperLink)"
            )
        if self.auth and self.tls is not None and len(self.tls.nodes) < len(self.nodes):
            raise ConfigError(f"--auth: {len(self.nodes)} SuperNodes but key pairs for {len(self.tls.nodes)}")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.home = self.work_dir / "flwr-home"

    def _env(self, home: Path) -> dict[str, str]:
        env = flwr_env(home, {**os.environ, **self.env})
        env[TOKEN_ENV] = self.token
        return env

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- start ---------------------------------------------------------------------------------

    def start(self, timeout_s: float = 90.0) -> None:
        """Start the SuperLink and every SuperNode; return once all are listed online. A reaper
        (:mod:`fedcomp.net.reaper`) goes first: should this process die without :meth:`stop`
        (SIGKILL), it stops them."""
        deadline = time.monotonic() + timeout_s
        if self.reaper is None:
            self.reaper = start_reaper(self.token, {**os.environ, **self.env})
            self.procs.append(self.reaper)
        lab = self.lab
        link_prefix = lab.exec_prefix(lab.link_ns) if lab else []
        for attempt in range(3):  # a probed port can be taken before the SuperLink binds it
            if lab:  # fresh namespaces: fixed ports; the SuperLink listens on its veth ends too
                self.port, node_ports, host = SUPERLINK_PORT, [SUPERNODE_PORT] * len(self.nodes), "0.0.0.0"
            else:
                ports = free_ports(1 + len(self.nodes))
                (self.port, *node_ports), host = ports, "127.0.0.1"
            log = self.work_dir / "superlink.log"
            self.home.mkdir(parents=True, exist_ok=True)
            security = ["--insecure"] if self.tls is None else self.tls.superlink_args()
            if self.auth:
                security.append("--enable-supernode-auth")
            link = self._spawn(
                [
                    *link_prefix, flwr_bin("flower-superlink"), *security, "--host", host, "--port", str(self.port),
                    "--disable-runtime-dependency-installation", "--log-file", str(log),
                ],
                self.home, self.work_dir / "superlink.out",
            )  # fmt: skip
            if self._wait_superlink(link, deadline):
                break
            if attempt == 2 or lab or link.poll() is None:
                raise DeployError(f"flower-superlink did not come up on port {self.port}\n{tail(log)}")
        (self.home / "config.toml").write_text(
            _connection_toml(
                CONNECTION, f"127.0.0.1:{self.port}", insecure=self.tls is None,
                root_certificates=str(self.tls.ca_cert) if self.tls else None,
            )
        )  # fmt: skip
        if self.auth:
            assert self.tls is not None
            for spec in self.nodes:
                self.registered[spec.index] = self.register_node(self.tls.nodes[spec.index].public, deadline)
        for spec, port in zip(self.nodes, node_ports, strict=True):
            key = self.tls.nodes[spec.index].private if self.auth and self.tls else None
            self.node_procs[spec.index] = self.spawn_supernode(
                f"node-{spec.index}", port, spec, private_key=key, index=spec.index
            )
        self._wait_nodes_online(deadline)

    def spawn_supernode(
        self,
        name: str,
        port: int,
        spec: NodeSpec | None = None,
        *,
        private_key: Path | None = None,
        insecure: bool | None = None,
        root_certificates: Path | None = None,
        max_wait_s: float | None = None,
        index: int = 0,
    ) -> subprocess.Popen[Any]:
        """Start one ``flower-supernode`` against this SuperLink; its log is ``<work>/<name>/supernode.log``.

        ``insecure`` defaults to "as the SuperLink" (``--root-certificates`` with TLS, the run's CA
        unless ``root_certificates`` names another); ``private_key``: its
        ``--auth-supernode-private-key``. Also how a drill starts a node the SuperLink should
        refuse (an unregistered key, no key, no TLS, another CA).
        """
        if self.port is None:
            raise DeployError("start() the deployment first")
        node_dir = self.work_dir / name
        (node_dir / "flwr-home").mkdir(parents=True, exist_ok=True)
        lab = self.lab
        if lab:
            prefix, superlink = lab.exec_prefix(lab.node_ns(index)), lab.superlink_address(index)
        else:
            prefix, superlink = [], f"127.0.0.1:{self.port}"
        insecure = self.tls is None if insecure is None else insecure
        cmd = [*prefix, flwr_bin("flower-supernode"), "--superlink", superlink, "--port", str(port)]
        if insecure:
            cmd.append("--insecure")
        elif root_certificates is not None or self.tls is not None:
            ca = root_certificates if root_certificates is not None else self.tls.ca_cert  # type: ignore[union-attr]
            cmd += ["--root-certificates", str(Path(ca).resolve())]
        if private_key is not None:
            cmd += ["--auth-supernode-private-key", str(Path(private_key).resolve())]
        cmd += ["--max-wait-time", f"{self.node_max_wait_s if max_wait_s is None else max_wait_s:g}"]
        if spec is not None:
            cmd += ["--node-config", spec.node_config_arg()]
        return self._spawn(cmd, node_dir / "flwr-home", node_dir / "supernode.log", cwd=node_dir)

    def register_node(self, public_key: Path, deadline: float | None = None) -> int:
        """``flwr supernode register KEY``: return the node id the SuperLink gave the key."""
        prefix = self.lab.exec_prefix(self.lab.link_ns) if self.lab else []
        timeout = 60.0 if deadline is None else max(5.0, deadline - time.monotonic())
        cmd = [*prefix, flwr_bin("flwr"), "supernode", "register", str(public_key), CONNECTION, "--format", "json"]
        try:
            out = subprocess.run(
                cmd, env=self._env(self.home), capture_output=True, text=True, timeout=timeout, cwd=self.work_dir,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise DeployError(f"flwr supernode register {public_key} did not answer within {timeout:.0f}s") from None
        try:
            data = json.loads(out.stdout[out.stdout.find("{") :])
        except json.JSONDecodeError:
            data = {}
        if not data.get("success") or "node-id" not in data:
            why = data.get("error-message") or _ANSI.sub("", (out.stdout + out.stderr).strip())[-2000:]
            raise DeployError(f"flwr supernode register {public_key} failed (exit {out.returncode}): {why}")
        return int(data["node-id"])

    def _spawn(self, cmd: list[str], home: Path, log: Path, cwd: Path | None = None) -> subprocess.Popen[Any]:
        with _appended_log(log, cmd) as out:
            proc = subprocess.Popen(
                cmd, cwd=cwd or self.work_dir, env=self._env(home), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    def _wait_superlink(self, link: subprocess.Popen[Any], deadline: float) -> bool:
        import httpx  # a flwr dependency

        while time.monotonic() < deadline:
            if link.poll() is not None:
                return False
            if self.lab is not None:  # its own namespace: probe from inside
                probe = f"import socket; socket.create_connection(('127.0.0.1', {self.port}), 1)"
                with contextlib.suppress(subprocess.TimeoutExpired):
                    cmd = [*self.lab.exec_prefix(self.lab.link_ns), sys.executable, "-c", probe]
                    if subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0:
                        return True
            else:
                scheme = "http" if self.tls is None else "https"
                with contextlib.suppress(httpx.HTTPError):
                    health = httpx.get(f"{scheme}://127.0.0.1:{self.port}/health", timeout=1.0, verify=self._verify())
                    if health.is_success:
                        return True
            time.sleep(0.25)
        raise DeployError(
            f"flower-superlink not healthy on 127.0.0.1:{self.port} in time\n{tail(self.work_dir / 'superlink.log')}"
        )

    def _verify(self) -> ssl.SSLContext | bool:
        """How a health probe checks the SuperLink's certificate: against the run's CA."""
        if self.tls is None:
            return True
        return ssl.create_default_context(cafile=str(self.tls.ca_cert))

    def online_nodes(self) -> list[str]:
        """Node ids the SuperLink lists as online (``flwr supernode ls --format json``)."""
        prefix = self.lab.exec_prefix(self.lab.link_ns) if self.lab else []
        out = subprocess.run(
            [*prefix, flwr_bin("flwr"), "supernode", "ls", CONNECTION, "--format", "json"],
            env=self._env(self.home), capture_output=True, text=True, timeout=30, cwd=self.work_dir,
        )  # fmt: skip
        try:
            data = json.loads(out.stdout)
        except json.JSONDecodeError:
            return []
        return [n["node-id"] for n in data.get("nodes", []) if n.get("status") == "online"]

    def _wait_nodes_online(self, deadline: float) -> None:
        want = len(self.nodes)
        online: list[str] = []
        while time.monotonic() < deadline:
            for spec in self.nodes:
                proc = self.node_procs[spec.index]
                log = self.work_dir / f"node-{spec.index}" / "supernode.log"
                if proc.poll() is not None:
                    raise DeployError(
                        f"SuperNode {spec.index} exited with code {proc.returncode} before the run"
                        f"{_exit_hint(log)}\n{tail(log)}"
                    )
            with contextlib.suppress(subprocess.TimeoutExpired):
                online = self.online_nodes()
            if len(online) >= want:
                return
            time.sleep(1.0)
        raise DeployError(
            f"only {len(online)} of {want} SuperNodes online in time\n{tail(self.work_dir / 'superlink.log')}"
        )

    # --- run -----------------------------------------------------------------------------------

    def run(
        self,
        run_config: Mapping[str, Any],
        timeout_s: float = 600.0,
        on_round: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Run the app once (``flwr run``) and return its results.json (status ``completed``).

        ``run_config`` must hold absolute ``results-dir`` and ``run-name`` (see
        :func:`deploy_local`, which fills them in).
        """
        if self.port is None:
            raise DeployError("start() the deployment first")
        results = Path(run_config["results-dir"]) / str(run_config["run-name"]) / RESULTS_FILE
        data = run_app(
            self.app_dir, f"127.0.0.1:{self.port}", run_config, flwr_home=self.home, timeout_s=timeout_s,
            insecure=self.tls is None, root_certificates=str(self.tls.ca_cert) if self.tls else None,
            env={**self.env, TOKEN_ENV: self.token}, log_path=self.work_dir / "flwr-run.log",
            echo=self.echo, results_path=results, on_round=on_round, procs=self.procs,
            prefix=self.lab.exec_prefix(self.lab.link_ns) if self.lab else (),
        )  # fmt: skip
        assert data is not None
        data["_deploy"] = {
            "results": str(results),
            "work_dir": str(self.work_dir),
            "token": self.token,
            "port": self.port,
            "tls": str(self.tls.folder) if self.tls else None,
            "auth": self.auth,
            "registered": {str(i): n for i, n in self.registered.items()},
        }
        return data

    def kill_node(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to SuperNode ``index``'s process group (its SuperExec and ClientApps)."""
        proc = self.node_procs[index]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def restart_node(self, index: int) -> None:
        """SIGKILL SuperNode ``index`` and start it again with its node config and folder (its
        FLWR_HOME, so its fedcomp client state): a SuperNode that restarts mid-run, which the
        SuperLink registers under a new node id (without ``auth``: a key keeps its id)."""
        spec = next(s for s in self.nodes if s.index == index)
        self.kill_node(index)
        key = self.tls.nodes[index].private if self.auth and self.tls else None
        port = SUPERNODE_PORT if self.lab else free_ports(1)[0]
        self.node_procs[index] = self.spawn_supernode(f"node-{index}", port, spec, private_key=key, index=index)

    def stop_session(self, proc: subprocess.Popen[Any], grace_s: float = 5.0) -> list[int]:
        """Stop one process this deployment started and everything in its session (a SuperNode's
        SuperExec and ClientApps), by PID: SIGTERM, then SIGKILL after ``grace_s``. The rest of
        the deployment runs on. Returns the PIDs it signalled."""
        members = sorted({proc.pid} | {pid for pid, (_, sid, _) in proc_table().items() if sid == proc.pid})
        for pid in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while alive_pids(members) and time.monotonic() < deadline:
            proc.poll()
            time.sleep(0.2)
        for pid in alive_pids(members):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        return members

    # --- stop ----------------------------------------------------------------------------------

    def stop(self, grace_s: float = 5.0) -> list[int]:
        """Stop every process this deployment started (SIGTERM, then SIGKILL); return their PIDs."""
        if self.procs:
            self.stopped_pids = sorted(set(self.stopped_pids) | terminate(self.procs, self.token, grace_s))
        return self.stopped_pids


#: Flower prints this (and exits 1) when a SuperNode gives up reaching its SuperLink.
_UNREACHABLE = "Exit Code: 305"


#: What Flower's SuperNode log says when the SuperLink refuses it, and what that means here.
REFUSALS = {
    "[code: 2004]": "the SuperLink refused it: its public key is not registered",
    "[code: 2001]": "the SuperLink refused it: authentication is on and it has no registered key",
    "Server disconnected without sending a response": "it spoke plain HTTP to a TLS SuperLink",
    "CERTIFICATE_VERIFY_FAILED": "it does not trust the SuperLink's certificate (wrong --root-certificates)",
}


def refusal_reason(log_text: str) -> str | None:
    """Why the SuperLink refused a SuperNode, from the SuperNode's log (None: no refusal seen)."""
    text = _ANSI.sub("", log_text)
    for marker, why in REFUSALS.items():
        if marker in text:
            return why
    return None


def _exit_hint(log: Path) -> str:
    try:
        text = _this_start(log)
    except OSError:
        return ""
    why = refusal_reason(text)
    if why is not None:
        return f" ({why})"
    return " (it could not reach the SuperLink)" if _UNREACHABLE in text else ""


def deploy_local(
    app_dir: str | Path,
    nodes: list[NodeSpec],
    run_config: Mapping[str, Any] | None = None,
    *,
    rounds: int | None = None,
    timeout_s: float = 600.0,
    work_dir: str | Path | None = None,
    results_dir: str | Path | None = None,
    echo: bool = False,
    on_round: Callable[[LocalDeployment, dict[str, Any]], None] | None = None,
    env: Mapping[str, str] | None = None,
    netns: bool = False,
    tls: bool = False,
    auth: bool = False,
) -> dict[str, Any]:
    """Start, run once, stop: the whole of ``python -m fedcomp.deploy local`` within ``timeout_s``.

    Returns the parsed results.json plus ``"_deploy": {"results", "work_dir", "token", "pids"}``
    (``pids``: every process found and stopped; see :func:`fedcomp.testing.flower.alive_pids`).
    ``work_dir`` defaults to ``<results-dir>/<run-name>/deploy`` (logs, FLWR_HOMEs).
    ``netns``: every process in its own network namespace, each SuperNode behind a veth pair
    shaped to its link (:mod:`fedcomp.net.netns`; raises NetnsUnavailable where not permitted).
    ``"_deploy"`` then also has ``"netns": {"latency_emulated": bool}``.
    ``tls``: a throwaway CA, server certificate (and with ``auth`` one key pair per node) in
    ``<work_dir>/tls`` (:mod:`fedcomp.net.tls`), and everything over TLS; ``auth``: SuperNode
    authentication, each node's public key registered before it starts (see
    :class:`LocalDeployment`). ``auth`` without ``tls`` is a :class:`ConfigError`.
    """
    if auth and not tls:
        raise ConfigError("--auth: SuperNode authentication needs --tls (Flower refuses it on an insecure SuperLink)")
    cfg = _with_run_defaults(run_config or {}, rounds, Path(results_dir) if results_dir else None)
    work = Path(work_dir) if work_dir else Path(cfg["results-dir"]) / str(cfg["run-name"]) / "deploy"
    deadline = time.monotonic() + timeout_s
    lab = NetnsLab([s.link for s in nodes]) if netns else None
    material = None
    if tls:
        # In namespaces the SuperNodes reach the SuperLink at its veth ends: the certificate names them too.
        hosts = (*DEFAULT_HOSTS, *(lab.superlink_address(s.index).rsplit(":", 1)[0] for s in nodes)) if lab else None
        material = make_tls_material(work / "tls", nodes=len(nodes) if auth else 0, hosts=hosts or DEFAULT_HOSTS)
    dep = LocalDeployment(Path(app_dir), nodes, work, echo=echo, env=dict(env or {}), lab=lab, tls=material, auth=auth)
    try:
        if lab is not None:
            lab.setup()
        dep.start(timeout_s=min(120.0, timeout_s))
        hook = (lambda entry: on_round(dep, entry)) if on_round else None
        data = dep.run(cfg, timeout_s=max(1.0, deadline - time.monotonic()), on_round=hook)
    finally:
        pids = dep.stop()
        sent = lab.sent_bytes() if lab is not None and lab.created else {}
        leftover = lab.teardown() if lab is not None else []
    if leftover:
        raise DeployError(f"network namespaces left behind: {leftover}")
    data["_deploy"]["pids"] = pids
    if lab is not None:
        data["_deploy"]["netns"] = {"name": lab.name, "latency_emulated": lab.latency_emulated, "sent_bytes": sent}
    left = alive_pids(pids)
    if left:
        raise DeployError(f"processes still alive after stopping: {left}")
    return data


# --- CLI ---------------------------------------------------------------------------------------


def _parse_run_config(items: list[str], flag: str = "--run-config") -> dict[str, Any]:
    """Parse ``--run-config`` (or ``--node-config``) items, later ones overriding earlier ones: a
    ``.toml`` file as ``flwr run`` reads it, any other item as ``python -m fedcomp run`` reads its
    text (:func:`~fedcomp.net.run_config.parse_run_config`: unquoted words are strings, and what
    Flower would silently drop, ``sbc-p=`` or a bare ``sbc-p``, is an error naming it)."""
    out: dict[str, Any] = {}
    for item in items:
        if item.endswith(".toml"):
            from flwr.common.config import parse_config_args

            try:
                out.update(parse_config_args([item]))
            except Exception as err:
                raise ConfigError(f"{flag}: {getattr(err, 'message', err)}") from None
            continue
        try:
            out.update(parse_run_config(item))
        except ConfigError as err:
            raise ConfigError(f"{flag}: {err}") from None
    return out


def _print_summary(data: dict[str, Any]) -> None:
    """One line of what results.json says, with only the figures it holds (an app of the user's
    own need not record accuracy, bytes or wall time: none is then printed as 0)."""
    rounds = data.get("rounds") or [{}]
    first, last = rounds[0], rounds[-1]
    done = len(rounds) - 1
    parts = [f"OK: run completed, {done} round{'' if done == 1 else 's'}"]
    if isinstance(first.get("accuracy"), float) and isinstance(last.get("accuracy"), float):
        parts.append(f"accuracy {first['accuracy']:.4f} -> {last['accuracy']:.4f}")
    for key, label in (("uplink_bytes", "uplink"), ("downlink_bytes", "downlink")):
        if any(key in r for r in rounds):
            parts.append(f"{label} {sum(r.get(key, 0) for r in rounds)} B")
    if isinstance(last.get("wall_time_s"), (int, float)):
        parts.append(f"wall {last['wall_time_s']:.1f}s")
    print(", ".join(parts) + f"\nresults: {data['_deploy']['results']}\nlogs:    {data['_deploy']['work_dir']}")


def _cmd_local(args: argparse.Namespace) -> int:
    specs = node_specs(args.nodes, args.links, args.node_config_file)  # validates before anything starts
    run_config = _parse_run_config(args.run_config)
    if args.auth and not args.tls:
        raise ConfigError("--auth: SuperNode authentication needs --tls (Flower refuses it on an insecure SuperLink)")
    if args.rounds is not None and args.rounds < 1:
        raise ConfigError(f"--rounds: must be >= 1 (got {args.rounds})")
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise ConfigError(f"--timeout: must be > 0 seconds (got {args.timeout:g})")
    check: RunConfigCheck | None = getattr(args, "check_run_config", None)
    if check is not None:  # the app's own validation, before any process starts
        rounds = {} if args.rounds is None else {"num-server-rounds": args.rounds}
        check(Path(args.app), {**run_config, **rounds})
    kills: dict[int, list[int]] = {}
    restarts: dict[int, list[int]] = {}
    for option, items, out in (("--kill-node", args.kill_node, kills), ("--restart-node", args.restart_node, restarts)):
        for item in items:
            m = re.fullmatch(r"(\d+)@(\d+)", item)
            if not m or int(m[1]) >= len(specs):
                raise ConfigError(f"{option}: expected NODE@ROUND with NODE < {len(specs)} (got {item!r})")
            out.setdefault(int(m[2]), []).append(int(m[1]))
    for s in specs:
        print(f"{s.name}: {s.node_config_arg()}")

    def on_round(dep: LocalDeployment, entry: dict[str, Any]) -> None:
        for i in kills.get(int(entry["round"]), []):
            print(f"[fedcomp.deploy] round {entry['round']} done: killing SuperNode {i} (SIGKILL)", flush=True)
            dep.kill_node(i)
        for i in restarts.get(int(entry["round"]), []):
            print(
                f"[fedcomp.deploy] round {entry['round']} done: restarting SuperNode {i} (SIGKILL, start)", flush=True
            )
            dep.restart_node(i)

    data = deploy_local(
        args.app, specs, run_config, rounds=args.rounds, timeout_s=args.timeout, work_dir=args.work_dir,
        results_dir=args.results_dir, echo=not args.quiet, on_round=on_round, netns=args.netns,
        tls=args.tls, auth=args.auth,
    )  # fmt: skip
    if args.netns and not data["_deploy"]["netns"]["latency_emulated"]:
        print("note: rates were shaped with tc, latency was not (this kernel has no sch_netem)")
    _print_summary(data)
    if data["_deploy"].get("tls"):
        if data["_deploy"]["auth"]:
            n = len(data["_deploy"]["registered"])
            what = f"ca.pem, server.pem/.key, node-<i>.key/.pub; SuperNode authentication on ({n} keys registered)"
        else:
            what = "ca.pem, server.pem/.key"
        print(f"tls:     {data['_deploy']['tls']} ({what})")
    return 0


def _cmd_supernode(args: argparse.Namespace) -> int:
    cfg: dict[str, Any] = {"partition-id": args.partition_id, "num-partitions": args.num_partitions}
    for key, value in (
        ("uplink-mbps", args.uplink_mbps),
        ("downlink-mbps", args.downlink_mbps),
        ("latency-ms", args.latency_ms),
    ):
        if value is not None:
            cfg[key] = value
    cfg.update(_parse_run_config(args.node_config, "--node-config"))
    pid = cfg.get("partition-id")
    spec = NodeSpec(pid if isinstance(pid, int) and not isinstance(pid, bool) else 0, cfg)  # (errors name it)
    _check_node(spec)
    if args.insecure and not _is_loopback(args.superlink):
        raise ConfigError(
            "--insecure: only for a SuperLink on loopback; pass --root-certificates CA.pem for a remote one"
        )
    if not args.insecure and not args.root_certificates:
        raise ConfigError("--root-certificates: needed for TLS (the CA that signed the SuperLink's certificate)")
    cmd = [
        flwr_bin("flower-supernode"),
        "--superlink",
        args.superlink,
        "--max-wait-time",
        f"{args.max_wait_time:g}",
        "--node-config",
        spec.node_config_arg(),
    ]
    cmd += ["--insecure"] if args.insecure else ["--root-certificates", str(Path(args.root_certificates).resolve())]
    if args.auth_key:
        if args.insecure:
            raise ConfigError(
                "--auth-key: SuperNode authentication needs TLS (drop --insecure, pass --root-certificates)"
            )
        key_file = Path(args.auth_key).expanduser()
        if not key_file.is_file():
            raise ConfigError(f"--auth-key: {key_file} is not a file")
        cmd += ["--auth-supernode-private-key", str(key_file.resolve())]
    if args.port:
        cmd += ["--port", str(args.port)]
    print("starting:", " ".join(cmd), flush=True)
    env = flwr_env(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")
    env[TOKEN_ENV] = token = uuid.uuid4().hex  # finds its SuperExec and ClientApps at the end
    proc = subprocess.Popen(
        cmd,
        start_new_session=True,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    seen: list[bool] = []
    lines: list[str] = []

    def relay() -> None:  # pass the SuperNode's log through, watching for "gave up"
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)
            del lines[:-50]
            if _UNREACHABLE in line:
                seen.append(True)

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        # After "Exit Code: 305" (refused, or gave up) Flower's SuperNode has been seen to hang on
        # its SuperExec for 40 s and more: give it a few seconds to exit, then stop it.
        given_up: float | None = None
        while proc.poll() is None:
            if seen and given_up is None:
                given_up = time.monotonic()
            if given_up is not None and time.monotonic() - given_up > 5.0:
                break
            time.sleep(0.2)
        code = proc.returncode if proc.returncode is not None else EXIT_FAILED
    finally:
        # Its SuperExec outlives it (and holds the pipe): stop the whole session, by marker.
        terminate([proc], token, grace_s=5.0)
        reader.join(timeout=5)
    refused = refusal_reason("".join(lines)) if seen else None
    if refused is not None:
        print(f"FAILED: this SuperNode was not admitted ({refused}; SuperLink {args.superlink})", file=sys.stderr)
        return EXIT_FAILED
    if seen:
        print(
            f"FAILED: the SuperNode could not reach the SuperLink at {args.superlink} within {args.max_wait_time:g}s",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE
    return code


def _cmd_run(args: argparse.Namespace) -> int:
    if args.insecure and not _is_loopback(args.superlink):
        raise ConfigError(
            "--insecure: only for a SuperLink on loopback; pass --root-certificates CA.pem for a remote one"
        )
    if not args.insecure and not args.root_certificates:
        raise ConfigError("--root-certificates: needed for TLS (the CA that signed the SuperLink's certificate)")
    cfg = _parse_run_config(args.run_config)
    if args.rounds is not None:
        cfg["num-server-rounds"] = args.rounds
    home = Path(args.work_dir or Path("results") / "deploy-run").resolve()
    run_app(
        args.app, args.superlink, cfg, flwr_home=home, timeout_s=args.timeout, insecure=args.insecure,
        root_certificates=args.root_certificates, echo=not args.quiet,
    )  # fmt: skip
    print("flwr run finished: the run completed (flwr ls); its results.json is on the SuperLink host")
    return 0


#: ``check(app_dir, run_config_overrides)``: raise ConfigError for a run config the app would refuse.
RunConfigCheck = Callable[[Path, dict[str, Any]], None]

#: Exit codes of ``python -m fedcomp.deploy`` (``--help`` prints them; tests check them).
EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_UNREACHABLE, EXIT_UNAVAILABLE = 0, 1, 2, 3, 4
EXIT_CODES = f"""exit codes:
  {EXIT_OK}    the run completed (results.json says "completed"); every process stopped
  {EXIT_FAILED}    the run failed or timed out, or a process did not start (the message and the logs say why)
  {EXIT_CONFIG}    bad configuration: a bad option, node config or run config (named in the message;
       nothing is started), or a run config the app refused at its start
  {EXIT_UNREACHABLE}    supernode: the SuperLink could not be reached within --max-wait-time
  {EXIT_UNAVAILABLE}    local --netns: network namespaces are not available here (needs root and iproute2)
  130  interrupted (Ctrl-C); 143: stopped by SIGTERM (everything started is stopped first)"""


def _cmd_certs(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out: {out} is not empty (never overwrite keys someone may use)")
    hosts = tuple(args.host) or DEFAULT_HOSTS
    m = make_tls_material(out, nodes=args.nodes, hosts=hosts)
    print(f"CA:          {m.ca_cert}  (give it to every SuperNode and flwr CLI: --root-certificates)")
    print(f"SuperLink:   {m.server_cert} {m.server_key}  (for {', '.join(hosts)})")
    print(f"             flower-superlink {' '.join(m.superlink_args())} [--enable-supernode-auth]")
    for i, node in enumerate(m.nodes):
        print(
            f"SuperNode {i}: {node.private} (its host only: --auth-key)  register: flwr supernode register {node.public}"
        )
    return EXIT_OK


def main(argv: list[str] | None = None, check_run_config: RunConfigCheck | None = None) -> int:
    """The CLI; returns its exit code (see :data:`EXIT_CODES`).

    ``check_run_config``: validates ``local``'s run config before anything starts (the app layer's
    :class:`~fedcomp.app.config.AppConfig`, passed in by :mod:`fedcomp.deploy`, which this layer
    may not import).
    """
    ap = argparse.ArgumentParser(
        prog="python -m fedcomp.deploy", description=__doc__.split("\n\n")[0], epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = ap.add_subparsers(dest="command", required=True)
    app_default = os.environ.get("FEDCOMP_APP_DIR", ".")

    loc = sub.add_parser(
        "local", help="SuperLink + N SuperNodes on 127.0.0.1, run the app, stop everything", epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    loc.add_argument("--nodes", "-n", type=int, default=None, help="number of SuperNodes (= partitions)")
    loc.add_argument("--rounds", "-r", type=int, default=None, help="num-server-rounds")
    loc.add_argument("--run-config", "-c", action="append", default=[], help="run-config overrides, as for flwr run")
    loc.add_argument(
        "--links",
        default=None,
        help=f'"UP,DOWN,LATENCY;..." Mbit/s, Mbit/s, ms, cycled over nodes (default "{DEFAULT_LINKS}")',
    )
    loc.add_argument("--node-config-file", default=None, help="TOML: [default] and one [[node]] table per node")
    loc.add_argument(
        "--timeout", "-t", type=float, default=600.0, help="bound on the whole deployment, seconds (default 600)"
    )
    loc.add_argument("--app", default=app_default, help="the app's folder (default: $FEDCOMP_APP_DIR or .)")
    loc.add_argument(
        "--results-dir", default=None, help="results root (default: results-dir, $FEDCOMP_RESULTS_DIR, ./results)"
    )
    loc.add_argument("--work-dir", default=None, help="logs and FLWR_HOMEs (default: <results>/<run-name>/deploy)")
    loc.add_argument(
        "--kill-node",
        action="append",
        default=[],
        metavar="NODE@ROUND",
        help="fault drill: SIGKILL SuperNode NODE once ROUND is recorded",
    )
    loc.add_argument(
        "--restart-node",
        action="append",
        default=[],
        metavar="NODE@ROUND",
        help="fault drill: SIGKILL SuperNode NODE once ROUND is recorded and start it again (a new node id, "
        "its saved client state)",
    )
    loc.add_argument("--quiet", "-q", action="store_true", help="don't echo the flwr run output")
    loc.add_argument("--netns", action="store_true", help="real shaped links: network namespaces + veth + tc (root)")
    loc.add_argument(
        "--tls",
        action="store_true",
        help="TLS everywhere: a throwaway CA and server certificate in <work-dir>/tls; nodes and CLI verify it",
    )
    loc.add_argument(
        "--auth",
        action="store_true",
        help="SuperNode authentication (needs --tls): a key pair per node, public keys registered first",
    )
    loc.set_defaults(func=_cmd_local, check_run_config=check_run_config)

    sn = sub.add_parser(
        "supernode", help="one SuperNode against a (remote) SuperLink, validated node config", epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sn.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink's Fleet API")
    sn.add_argument("--root-certificates", default=None, help="CA certificate (PEM) for TLS")
    sn.add_argument("--insecure", action="store_true", help="no TLS (loopback SuperLinks only)")
    sn.add_argument(
        "--auth-key",
        default=None,
        help="the node's private key (OpenSSH, ECDSA P-384) when the SuperLink authenticates SuperNodes",
    )
    sn.add_argument("--partition-id", type=int, required=True)
    sn.add_argument("--num-partitions", type=int, required=True)
    sn.add_argument("--uplink-mbps", type=float, default=None)
    sn.add_argument("--downlink-mbps", type=float, default=None)
    sn.add_argument("--latency-ms", type=float, default=None)
    sn.add_argument("--node-config", action="append", default=[], help="more node-config key=value pairs")
    sn.add_argument(
        "--max-wait-time", type=float, default=60.0, help="give up reaching the SuperLink after this many seconds"
    )
    sn.add_argument("--port", type=int, default=None, help="local ClientAppIo/Runtime API port (default 9094)")
    sn.set_defaults(func=_cmd_supernode)

    rn = sub.add_parser("run", help="submit the app to a running (remote) SuperLink and stream its logs")
    rn.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink")
    rn.add_argument("--root-certificates", default=None)
    rn.add_argument("--insecure", action="store_true")
    rn.add_argument("--rounds", "-r", type=int, default=None)
    rn.add_argument("--run-config", "-c", action="append", default=[])
    rn.add_argument("--timeout", "-t", type=float, default=3600.0)
    rn.add_argument("--app", default=app_default)
    rn.add_argument("--work-dir", default=None, help="FLWR_HOME for the CLI (default ./results/deploy-run)")
    rn.add_argument("--quiet", "-q", action="store_true")
    rn.set_defaults(func=_cmd_run)

    ce = sub.add_parser("certs", help="make a throwaway CA, a server certificate and node key pairs in a folder")
    ce.add_argument("--out", required=True, help="folder to create (must be new or empty)")
    ce.add_argument("--nodes", type=int, default=0, help="SuperNode key pairs to make (for --enable-supernode-auth)")
    ce.add_argument(
        "--host",
        action="append",
        default=[],
        help="a name or IP the SuperLink is reached at (repeat; default 127.0.0.1, ::1, localhost)",
    )
    ce.set_defaults(func=_cmd_certs)

    args = ap.parse_args(argv)

    def _sigterm(signum: int, frame: Any) -> None:  # run the cleanup in `finally` blocks
        raise SystemExit(128 + signum)

    previous = None
    with contextlib.suppress(ValueError):  # not in the main thread
        previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        return int(args.func(args))
    except ConfigError as err:
        print(f"CONFIG ERROR: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except DeployError as err:
        if err.config_error:  # the ServerApp refused its run config at start
            print(f"CONFIG ERROR: the app refused its run config: {(err.results or {}).get('error')}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"FAILED: {err}", file=sys.stderr)
        return EXIT_FAILED
    except FlowerProcessError as err:
        print(f"FAILED: {err}", file=sys.stderr)
        return EXIT_FAILED
    except NetnsUnavailable as err:
        print(f"NOT AVAILABLE: --netns: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:  # the `finally` blocks have stopped what was started
        print("INTERRUPTED", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
