"""Ctrl-C and interpreter exit around a manager's saves (issue 32 §4), each in a real
subprocess (interrupt_job.py) that sends itself SIGINT from inside the save's first write.

- A SIGINT during a synchronous save leaves the process as a ``KeyboardInterrupt`` (before: a
  ``CheckpointError`` wrapping DCP's ``CheckpointException``, which code catching
  ``CheckpointError`` to keep training would swallow); the partial step is cleaned up and the
  previous checkpoint still loads.
- A SIGINT, or the script's end, with an async save in flight: the save is finished before
  the interpreter exits (before: "cannot schedule new futures after interpreter shutdown" and
  a lost step); past ``timeout_s`` it is abandoned with one line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from goodput_ckpt import CheckpointManager

JOB = Path(__file__).with_name("interrupt_job.py")


def _run(root: Path, mode: str) -> subprocess.CompletedProcess:
    # torch.cuda's import warns on stderr where the deprecated pynvml package is installed (it
    # comes with nvidia-resiliency-ext, the `bench` extra): not this job's output, which is checked.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONWARNINGS="ignore::FutureWarning:torch.cuda")
    return subprocess.run(
        [sys.executable, str(JOB), str(root), mode], capture_output=True, text=True, timeout=300, env=env
    )


def _restored(root: Path) -> tuple[int | None, dict]:
    model = torch.nn.Linear(256, 256)
    with CheckpointManager(root, async_save=False) as mgr:
        step = mgr.restore(model=model)
    return step, model.state_dict()


def test_sigint_during_a_sync_save_raises_keyboard_interrupt_and_keeps_the_previous_step(tmp_path):
    root = tmp_path / "run"
    proc = _run(root, "sync-sigint")
    assert proc.returncode == -signal.SIGINT, proc.stderr  # Python's exit for an uncaught Ctrl-C
    assert proc.stderr.rstrip().splitlines()[-1] == "KeyboardInterrupt", proc.stderr
    assert "CheckpointError" not in proc.stderr and "CheckpointException" not in proc.stderr, proc.stderr
    step, state = _restored(root)
    assert step == 1
    want = torch.load(root / "state.pt")
    assert all(torch.equal(state[k], want[k]) for k in want)
    assert not (root / "step_00000002").exists()  # the partial save was cleaned up


@pytest.mark.parametrize("mode", ["async-sigint", "async-exit"])
def test_an_async_save_in_flight_at_exit_is_finished(tmp_path, mode):
    root = tmp_path / "run"
    proc = _run(root, mode)
    assert "cannot schedule" not in proc.stderr and "failed" not in proc.stderr, proc.stderr
    if mode == "async-sigint":
        assert proc.returncode == -signal.SIGINT and proc.stderr.rstrip().endswith("KeyboardInterrupt"), proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
    step, _ = _restored(root)
    assert step == 2


def test_an_async_save_that_outlasts_timeout_s_at_exit_is_abandoned_in_one_line(tmp_path):
    root = tmp_path / "run"
    proc = _run(root, "async-abandon")
    assert proc.returncode == 0, proc.stderr
    assert "cannot schedule" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "the save of step 2 was abandoned" in lines[0], proc.stderr
    assert _restored(root)[0] == 1
