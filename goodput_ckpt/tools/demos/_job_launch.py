"""Start a multi-process job, follow rank 0's output, SIGKILL it whole: the demo's launcher.

Every rank runs in its own session, so a SIGKILL of the session takes the processes it started
(dataloader workers) too, and only processes this launcher started are ever signalled.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import threading
import time

__all__ = ["JobLaunch", "free_port"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JobLaunch:
    """One start of a job: ``commands[r]`` is rank ``r``'s command line.

    Rank 0's stdout is parsed line by line (:meth:`next_line`) and copied to
    ``LOGS/TAG-rank0.out``; the other ranks' stdout and every rank's stderr go to
    ``LOGS/TAG-rankR.out`` / ``.err``.
    """

    def __init__(self, commands: list[list[str]], logs: str, tag: str, env: dict[str, str] | None = None) -> None:
        self.tag, self.logs = tag, logs
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.procs: list[subprocess.Popen] = []
        self.started = time.time()
        try:
            for rank, cmd in enumerate(commands):
                with open(os.path.join(logs, f"{tag}-rank{rank}.err"), "w") as err:
                    stdout = subprocess.PIPE if rank == 0 else open(os.path.join(logs, f"{tag}-rank{rank}.out"), "w")  # noqa: SIM115
                    try:
                        self.procs.append(
                            subprocess.Popen(cmd, stdout=stdout, stderr=err, text=True, start_new_session=True, env=env)
                        )
                    finally:
                        if stdout is not subprocess.PIPE:
                            stdout.close()
        except BaseException:
            self.kill()
            raise
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        stream = self.procs[0].stdout
        assert stream is not None
        with open(os.path.join(self.logs, f"{self.tag}-rank0.out"), "w") as log:
            for line in stream:
                log.write(line)
                log.flush()
                self.lines.put(line.strip())
        self.lines.put(None)

    def next_line(self, deadline: float) -> str | None:
        """Rank 0's next line, or ``None`` once its stdout closed.

        Raises:
            RuntimeError: nothing came before ``deadline`` (``time.monotonic()``).
        """
        try:
            return self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"{self.tag}: no output for too long{self.why()}") from None

    def why(self) -> str:
        """The last lines of every rank's stderr, for error messages."""
        tails = []
        for rank in range(len(self.procs)):
            path = os.path.join(self.logs, f"{self.tag}-rank{rank}.err")
            with open(path, errors="replace") as f:
                err = [ln for ln in f.read().splitlines() if ln.strip()]
            if err:
                tails.append(f"\n  rank {rank} stderr ({path}) ends:\n    " + "\n    ".join(err[-8:]))
        return "".join(tails)

    def kill(self) -> float:
        """SIGKILL every process of the job and reap the ranks; return when the signal went."""
        at = time.time()
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait(60)
        return at

    def finish(self, deadline: float) -> None:
        """Wait for every rank to exit.

        Raises:
            RuntimeError: a rank exited with a non-zero status, or not before ``deadline``.
        """
        for p in self.procs:
            try:
                rc = p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{self.tag}: the job did not exit{self.why()}") from None
            if rc != 0:
                raise RuntimeError(f"{self.tag}: a rank exited with status {rc}{self.why()}")
