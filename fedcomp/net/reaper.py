"""Stop a run's processes when the command that started them dies without stopping them.

``python -m fedcomp.deploy local`` starts its SuperLink, SuperNodes and ``flwr run`` in sessions
of their own, so that it can stop each by PID. It stops them itself at the end, on Ctrl-C and on
SIGTERM. On SIGKILL, or when the machine's OOM killer takes it, it cannot: the processes kept
running and held their ports (a deployment audit found the SuperLink, both SuperNodes and three
SuperExecs still up). A reaper watches the command instead. It is a small process of its own
session, started first, that polls whether its parent lives. Once the parent is gone, it stops
every process marked with the run's token (:func:`fedcomp.net.superlink.terminate`: SIGTERM,
then SIGKILL), then exits. A normal stop ends the reaper with the rest, since it carries the token.

``subprocess``'s ``preexec_fn`` with ``PR_SET_PDEATHSIG`` would do it per child, but
``preexec_fn`` is unsafe in a process with threads, as the deployment is (it pumps output).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping

from fedcomp.net.superlink import TOKEN_ENV, start_time, terminate

__all__ = ["POLL_S", "start_reaper", "watch"]

#: How often the reaper looks at its parent (seconds).
POLL_S = 0.5


def watch(parent: int, token: str, poll_s: float = POLL_S) -> None:
    """Wait while ``parent`` lives, then stop every process marked with ``token``."""
    born = start_time(parent)
    while born is not None and start_time(parent) == born:
        time.sleep(poll_s)
    terminate([], token, grace_s=5.0)


def start_reaper(token: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A reaper for this process and the processes marked with ``token`` (its own session, output
    discarded). It carries the token itself, so stopping the run stops it too."""
    child_env = {**(os.environ if env is None else env), TOKEN_ENV: token}
    return subprocess.Popen(
        [sys.executable, "-m", "fedcomp.net.reaper", str(os.getpid()), token],
        env=child_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
