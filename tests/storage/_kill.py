"""Kill a save mid-write: the subprocess half of the SIGKILL tests of the stores."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from helpers.wait import wait_until


def kill_when(args: Sequence[str], log_path: Path, ready: Callable[[], bool], timeout: float = 120.0) -> None:
    """Run ``args`` (a worker that prints ``READY`` once its state is built, then saves) and
    SIGKILL it as soon as ``ready()`` is true, so that no clean-up of its own can run.

    Raises:
        AssertionError: the worker failed to start, or finished before ``ready()`` held.
        TimeoutError: ``ready()`` did not hold within ``timeout`` while the worker ran.
    """
    with open(log_path, "w") as log:
        proc = subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert proc.stdout.readline().strip() == "READY", log_path.read_text()
            wait_until(lambda: proc.poll() is not None or ready(), timeout, interval=0.01, what="the moment to kill")
            assert proc.poll() is None, "the save finished before it could be killed"
            proc.kill()  # SIGKILL
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
