"""A fork server for crash trials: one process imports torch once, then forks a child per trial.

Interpreter start-up with torch takes 3-4 s on the CI machines, longer than a whole trial, so
SIGKILL trials do not start ``python`` per trial. :class:`Forker` starts this module as a
process (the *zygote*) that imports torch, DCP, boto3 and goodput-ckpt, starts no thread, and
then forks one child per :meth:`Forker.run`. A child runs ``module:function(**kwargs)`` with its
stdout and stderr sent to a log file and exits. The test SIGKILLs the child by PID, or lets it
finish; the zygote reaps it only when asked (:meth:`Child.wait`), so its PID can never be reused
by another process before the test is done with it.

Protocol (JSON lines; requests on the zygote's stdin, one answer each on its stdout)::

    {"op": "run", "target": "crash_worker:run", "kwargs": {...}, "log": PATH} -> {"pid": N}
    {"op": "reap", "pid": N}                                                -> {"rc": RC}

``RC`` is the child's exit status, or minus the signal that ended it (``-9`` after SIGKILL).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import traceback
from pathlib import Path

__all__ = ["Child", "Forker"]

#: Modules every child needs, imported once by the zygote before it forks.
_PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "boto3",
    "goodput_ckpt",
    "goodput_ckpt.manager.checkpoint_manager",
    "goodput_ckpt.tools.ops.ls",
    "goodput_ckpt.tools.ops.verify",
)


class Child:
    """One forked child of the zygote (a trial's saving process)."""

    def __init__(self, forker: Forker, pid: int, log: Path) -> None:
        self.forker = forker
        self.pid = pid
        self.log = log
        self.rc: int | None = None

    def kill(self) -> None:
        """SIGKILL the child (harmless when it already exited: it stays a zombie until reaped)."""
        if self.rc is None:
            os.kill(self.pid, signal.SIGKILL)

    def exited(self) -> bool:
        """Whether the child has exited (it is then a zombie until reaped), without reaping it."""
        if self.rc is not None:
            return True
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            return True
        return state in (b"Z", b"X")

    def wait(self, timeout: float = 120.0) -> int:
        """Reap the child; SIGKILL it first when it is still running after ``timeout`` seconds."""
        if self.rc is None:
            self.rc = self.forker._reap(self.pid, timeout)
        return self.rc

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""


class Forker:
    """The parent's handle on a zygote process (started with the given environment)."""

    def __init__(self, env: dict[str, str] | None = None, log: Path | None = None) -> None:
        full_env = {**os.environ, **(env or {})}
        # One thread per library pool: forking a process with live BLAS/OpenMP threads is unsafe.
        full_env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self._err = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=full_env,
        )
        self._children: list[Child] = []
        ready = self._answer(120.0)
        if ready.get("ready") is not True:
            self.stop()
            raise RuntimeError(f"the fork server did not start: {ready}")

    def run(self, target: str, kwargs: dict, log: Path) -> Child:
        """Fork a child that runs ``target`` (``"module:function"``) with ``kwargs``."""
        self._send({"op": "run", "target": target, "kwargs": kwargs, "log": str(log)})
        child = Child(self, int(self._answer(60.0)["pid"]), log)
        self._children.append(child)
        return child

    def _reap(self, pid: int, timeout: float) -> int:
        self._send({"op": "reap", "pid": pid})
        try:
            return int(self._answer(timeout)["rc"])
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)  # not reaped yet: the PID is still this child's
            return int(self._answer(60.0)["rc"])

    def _send(self, msg: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
        self.proc.stdin.flush()

    def _answer(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError("no answer from the fork server")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited (rc {self.proc.poll()})")
        return json.loads(line)

    def stop(self) -> None:
        """Kill and reap every child still running, then end the zygote (all by PID)."""
        for child in self._children:
            if child.rc is None and self.proc.poll() is None:
                try:
                    child.kill()
                    child.wait(30.0)
                except (OSError, RuntimeError, TimeoutError):
                    pass
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        if self._err is not subprocess.DEVNULL:
            self._err.close()


# -- the zygote -------------------------------------------------------------------------------------
def _child(target: str, kwargs: dict, log: str) -> None:
    """In the forked child: redirect output, run the target, exit without Python's clean-up."""
    rc = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        module, _, function = target.partition(":")
        getattr(importlib.import_module(module), function)(**kwargs)
        rc = 0
    except BaseException:  # noqa: BLE001 - report anything, then exit with a status
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def _zygote() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    for name in _PRELOAD:
        importlib.import_module(name)
    out = sys.stdout.buffer

    def answer(msg: dict) -> None:
        out.write(json.dumps(msg).encode() + b"\n")
        out.flush()

    answer({"ready": True})
    for line in sys.stdin.buffer:
        req = json.loads(line)
        if req["op"] == "run":
            importlib.import_module(req["target"].partition(":")[0])  # once, before forking
            pid = os.fork()
            if pid == 0:
                _child(req["target"], req["kwargs"], req["log"])
            answer({"pid": pid})
        elif req["op"] == "reap":
            _, status = os.waitpid(req["pid"], 0)
            answer({"rc": os.waitstatus_to_exitcode(status)})
        else:
            answer({"error": f"unknown op {req['op']!r}"})


if __name__ == "__main__":
    _zygote()
