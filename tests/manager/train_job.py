"""The small training job of the resume acceptance test (test_resume.py): the demo's job
(``goodput_ckpt/tools/demos/_demo_job.py``), run with this test's sizes.

Each rank is ``python -m goodput_ckpt.tools.demos._demo_job`` (:func:`command`). Without a root it
is the reference run: the same job with the same seeds and no manager at all. With one, it
restores, then saves every ``save_every`` steps and at the last step. It prints ``RESTORED
s|none``, ``SAVED s``, ``STEP s`` (then times) and ``DONE``, flushed, so the parent can SIGKILL
it at chosen moments; at the end every rank writes ``DIR/fingerprint-rank{R}.json``
(:func:`fingerprint_file`), digests of what an exact resume must reproduce.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from goodput_ckpt.tools.demos._demo_job import BATCH, Samples, make_model, make_optimizer, state_fingerprint
from goodput_ckpt.tools.demos._job_launch import JobLaunch, free_port

__all__ = [
    "BATCH",
    "WIDTH",
    "Job",
    "Samples",
    "command",
    "fingerprint_file",
    "make_model",
    "make_optimizer",
    "state_fingerprint",
]

WIDTH = 256  # ~1.2 MB of parameters, ~3.5 MB with AdamW state: saves take a few ms to tens of ms


def command(
    rank: int,
    world_size: int,
    port: int,
    out: Path,
    *,
    steps: int,
    save_every: int,
    root: Path | None,
    elastic: bool = False,
    options: dict[str, Any] | None = None,
) -> list[str]:
    """The command line of one rank (run it from the repository root, as pytest is). ``elastic``:
    the loaders use ``goodput_ckpt.data.ElasticSampler`` instead of ``shuffle=True``;
    ``options``: more ``CheckpointManager`` keyword arguments (JSON values)."""
    cmd = [
        sys.executable,
        "-m",
        "goodput_ckpt.tools.demos._demo_job",
        "--rank",
        str(rank),
        "--world-size",
        str(world_size),
        "--port",
        str(port),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--width",
        str(WIDTH),
        "--save-every",
        str(save_every),
    ]
    if root is not None:
        cmd += ["--root", str(root)]
    for key, value in (options or {}).items():
        cmd += ["-o", f"{key}={json.dumps(value)}"]
    return cmd + ["--elastic"] * elastic


class Job(JobLaunch):
    """One launch of the job on ``world`` ranks (the demo's launcher: each rank in its own
    session, so a SIGKILL of the session takes its dataloader workers too). ``root=None``: the
    reference run, without a manager."""

    def __init__(
        self,
        out: Path,
        logs: Path,
        root: Path | None,
        tag: str,
        *,
        world: int,
        steps: int,
        save_every: int,
        elastic: bool = False,
        options: dict[str, Any] | None = None,
    ) -> None:
        port = free_port()
        out.mkdir(parents=True, exist_ok=True)
        logs.mkdir(parents=True, exist_ok=True)
        commands = [
            command(
                rank, world, port, out, steps=steps, save_every=save_every, root=root, elastic=elastic, options=options
            )
            for rank in range(world)
        ]
        # The ranks import goodput_ckpt from this checkout, not from wherever it is installed.
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
        }
        super().__init__(commands, str(logs), tag, env=env)
        self.log: list[str] = []

    def next_line(self, deadline: float) -> str | None:
        try:
            line = super().next_line(deadline)
        except RuntimeError as e:
            raise AssertionError(str(e)) from None
        if line is not None:
            self.log.append(line)
        return line

    def wait_for(self, prefix: str, deadline: float) -> str:
        while True:
            line = self.next_line(deadline)
            if line is None:
                raise AssertionError(f"rank 0 exited before {prefix!r}; output ends {self.log[-5:]}{self.why()}")
            if line.startswith(prefix):
                return line

    def finish(self, deadline: float) -> None:
        while self.next_line(deadline) is not None:
            pass
        try:
            super().finish(deadline)
        except RuntimeError as e:
            raise AssertionError(str(e)) from None


def fingerprint_file(out: Path, rank: int) -> dict[str, Any]:
    """What rank ``rank`` of the job run in ``out`` wrote at its end."""
    return json.loads((out / f"fingerprint-rank{rank}.json").read_text())
