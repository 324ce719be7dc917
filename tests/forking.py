"""Running a function in a forked child and taking its result (for the tests that a kernel works
in a process forked after torch's OpenMP team ran, where that team is gone)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any


def result_in_fork(target: Callable[[Any], None], timeout: float = 120.0) -> tuple[object, int | None]:
    """``target(queue)`` in a forked child: what it put on the queue, and the child's exit code
    (the child is killed if it is still alive 10 s after the result, or after ``timeout``)."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=target, args=(queue,))
    child.start()
    try:
        got = queue.get(timeout=timeout)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    return got, child.exitcode
