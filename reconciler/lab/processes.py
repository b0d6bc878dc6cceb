"""Child processes of tests and benchmarks (engines, etcd, Prometheus, fake fleets): stopped the same way, and
conditions waited for with a deadline (every wait in a test is bounded)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL if it has not ended within ``timeout`` seconds; reaped either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def wait_until(predicate: Callable[[], T], timeout: float, poll: float = 0.5) -> T | None:
    """``predicate()``'s first truthy value within ``timeout`` seconds, polled every ``poll``; None after that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    return None
