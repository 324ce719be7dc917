"""fedcomp.net.reaper: the run's processes are stopped when the command that started them dies
without stopping them (SIGKILL), and left alone while it lives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

from fedcomp.net.superlink import is_alive

# A command that starts a reaper and one marked process of its own session (as the deployment
# starts its SuperLink), prints their PIDs, then waits to be killed.
_COMMAND = """
import os, subprocess, sys, time
from fedcomp.net.reaper import start_reaper
from fedcomp.net.superlink import TOKEN_ENV
token = sys.argv[1]
reaper = start_reaper(token)
child = subprocess.Popen(["sleep", "120"], env={**os.environ, TOKEN_ENV: token}, start_new_session=True)
print(reaper.pid, child.pid, flush=True)
time.sleep(120)
"""


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if is_alive(p)]
        if not alive:
            return []
        time.sleep(0.2)
    return [p for p in pids if is_alive(p)]


def test_a_killed_command_leaves_nothing_running_and_a_live_one_is_left_alone() -> None:
    token = uuid.uuid4().hex
    cmd = subprocess.Popen([sys.executable, "-c", _COMMAND, token], stdout=subprocess.PIPE, text=True)
    started: list[int] = []
    try:
        assert cmd.stdout is not None
        started = [int(x) for x in cmd.stdout.readline().split()]
        reaper, child = started
        time.sleep(2.0)  # four polls of a live parent: nothing is stopped
        assert is_alive(reaper) and is_alive(child)
        os.kill(cmd.pid, signal.SIGKILL)
        cmd.wait(timeout=10)
        assert _wait_gone([child, reaper], timeout_s=20.0) == []
    finally:
        cmd.kill()
        for pid in started:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)


# `deploy run`'s own processes: run_app with a stand-in `flwr` that writes its PID and waits.
_DEPLOY_RUN = """
import sys
from pathlib import Path
import fedcomp.net.deploy as deploy
work = Path(sys.argv[1])
deploy.flwr_bin = lambda name: str(work / "flwr")
deploy.run_app(work / "app", "127.0.0.1:9093", {}, flwr_home=work / "home", timeout_s=120, insecure=True)
"""


def test_a_killed_deploy_run_leaves_no_flwr_run_behind(tmp_path) -> None:
    """``python -m fedcomp.deploy run`` (a remote SuperLink) starts ``flwr run`` in a session of
    its own; killed with SIGKILL, it left that process streaming on. Its reaper now stops it."""
    (tmp_path / "app").mkdir()
    fake = tmp_path / "flwr"
    fake.write_text(f"#!/bin/sh\necho $$ > {tmp_path / 'pid'}\nexec sleep 120\n")
    fake.chmod(0o755)
    cmd = subprocess.Popen([sys.executable, "-c", _DEPLOY_RUN, str(tmp_path)])
    flwr = 0
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "pid").is_file() or not (tmp_path / "pid").read_text().strip():
            assert time.monotonic() < deadline, "the stand-in flwr never started"
            time.sleep(0.2)
        flwr = int((tmp_path / "pid").read_text())
        time.sleep(1.5)  # (polls of a live parent: nothing is stopped)
        assert is_alive(flwr)
        os.kill(cmd.pid, signal.SIGKILL)
        cmd.wait(timeout=10)
        assert _wait_gone([flwr], timeout_s=20.0) == []
    finally:
        cmd.kill()
        if flwr and is_alive(flwr):
            os.kill(flwr, signal.SIGKILL)
