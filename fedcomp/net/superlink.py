"""Start, watch and stop Flower's own processes (SuperLink, SuperNodes) by PID, never by name.

Every process a run starts inherits a marker variable (``FEDCOMP_SIM_TOKEN``); :func:`terminate`
finds them by that marker, their parents and their sessions (Ray's daemons overwrite their
environment when they set their title) and sends SIGTERM, then SIGKILL. Used by the local
deployment (:mod:`fedcomp.net.deploy`) and the simulation driver (:mod:`fedcomp.testing.flower`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "TOKEN_ENV",
    "FlowerProcessError",
    "alive_pids",
    "find_marked_pids",
    "flwr_bin",
    "flwr_env",
    "free_port",
    "is_alive",
    "proc_table",
    "run_pids",
    "start_time",
    "tail",
    "terminate",
    "wait_healthy",
]

#: Marker variable every process of one run inherits.
TOKEN_ENV = "FEDCOMP_SIM_TOKEN"


class FlowerProcessError(RuntimeError):
    """A Flower process could not be found, started or brought up."""


def flwr_env(flwr_home: str | Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for the Flower CLI/SuperLink: own FLWR_HOME, no telemetry, no installs."""
    env = dict(os.environ if base is None else base)
    env.update(
        FLWR_HOME=str(flwr_home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",  # silences a Ray FutureWarning per worker
        PYTHONUNBUFFERED="1",
    )
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flwr_bin(name: str) -> str:
    """A console script next to this interpreter (the venv's), else on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise FlowerProcessError(f"{name!r} not found next to {sys.executable} or on PATH")
    return found


def find_marked_pids(token: str) -> list[int]:
    """PIDs of this user's processes whose environment has ``FEDCOMP_SIM_TOKEN=<token>``."""
    needle = f"{TOKEN_ENV}={token}".encode()
    me = os.getpid()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:  # gone, or not ours
            continue
    return pids


def proc_table(names: dict[int, str] | None = None) -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, session id, state) for every process, from /proc/<pid>/stat; with ``names``,
    each process's name (``comm``) is put there too, from the same read."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                head, tail = f.read().rsplit(b")", 1)
            fields = tail.split()
            table[int(entry)] = (int(fields[1]), int(fields[3]), fields[0].decode())
            if names is not None:
                names[int(entry)] = head.split(b"(", 1)[1].decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
    return table


def run_pids(token: str, roots: list[int]) -> set[int]:
    """Every live process of the run: the roots, marked processes, their descendants, their
    sessions.

    The marker alone is not enough: Ray's Python daemons overwrite their environment when they
    set their process title, so they are found through their parent (while it lives) or their
    session id (which survives re-parenting). This process's own session is never included.
    """
    table = proc_table()
    me, own_sid = os.getpid(), os.getsid(0)
    selected = {p for p in (*roots, *find_marked_pids(token)) if p in table and p != me}
    while True:
        sids = {table[p][1] for p in selected} - {own_sid}
        more = {
            pid
            for pid, (ppid, sid, _) in table.items()
            if pid not in selected and pid != me and (ppid in selected or sid in sids)
        }
        if not more:
            return {p for p in selected if table[p][2] != "Z"}  # zombies are already dead
        selected |= more


def terminate(procs: list[subprocess.Popen[Any]], token: str, grace_s: float = 5.0) -> set[int]:
    """SIGTERM every process of the run, wait up to ``grace_s``, SIGKILL what is left.

    Returns the PIDs it found (to check later that none of them lives on).
    """
    roots = [p.pid for p in procs]
    targets = run_pids(token, roots)
    for pid in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        for p in procs:
            p.poll()  # reap our direct children
        alive = run_pids(token, roots) | {p for p in targets if is_alive(p)}
        if not alive:
            break
        targets |= alive
        time.sleep(0.2)
    for pid in run_pids(token, roots) | {p for p in targets if is_alive(p)}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=2)
    return targets | set(roots)


def alive_pids(pids: list[int] | set[int]) -> list[int]:
    """Those of ``pids`` that still run (zombies count as dead)."""
    return sorted(p for p in pids if is_alive(p))


def is_alive(pid: int) -> bool:
    return start_time(pid) is not None


def start_time(pid: int) -> str | None:
    """The process's start time since boot (field 22 of /proc/PID/stat), which tells a process
    from a later one given the same PID; None when it is gone or a zombie (dead, waiting for its
    parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return None if fields[0] == b"Z" else fields[19].decode()
    except (OSError, IndexError):
        return None


def wait_healthy(port: int, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    import httpx  # a flwr dependency

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise FlowerProcessError(f"flower-superlink exited with code {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).is_success:
                return
        time.sleep(0.25)
    raise FlowerProcessError(f"flower-superlink not healthy on port {port} after {timeout_s:.0f}s")


def tail(path: Path, n: int = 60) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"({path} unreadable)"
    return "\n".join(lines[-n:])
