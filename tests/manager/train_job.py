"""The small training job of the resume acceptance test (test_resume.py): the demo's job
(``goodput_ckpt/tools/_demo_job.py``), run with this test's sizes.

Each rank is ``python -m goodput_ckpt.tools._demo_job`` (:func:`command`). Without a root it
is the reference run: the same job with the same seeds and no manager at all. With one, it
restores, then saves every ``save_every`` steps and at the last step. It prints ``RESTORED
s|none``, ``SAVED s``, ``STEP s`` (then times) and ``DONE``, flushed, so the parent can SIGKILL
it at chosen moments; at the end every rank writes ``DIR/fingerprint-rank{R}.json``
(:func:`fingerprint_file`), digests of what an exact resume must reproduce.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from goodput_ckpt.tools._demo_job import BATCH, Samples, make_model, make_optimizer, state_fingerprint

__all__ = [
    "BATCH", "WIDTH", "Samples", "command", "fingerprint_file", "make_model", "make_optimizer", "state_fingerprint",
]  # fmt: skip

WIDTH = 256  # ~1.2 MB of parameters, ~3.5 MB with AdamW state: saves take a few ms to tens of ms


def command(
    rank: int, world_size: int, port: int, out: Path, *, steps: int, save_every: int, root: Path | None,
    elastic: bool = False,
) -> list[str]:
    """The command line of one rank (run it from the repository root, as pytest is). ``elastic``:
    the loaders use ``goodput_ckpt.data.ElasticSampler`` instead of ``shuffle=True``."""
    cmd = [sys.executable, "-m", "goodput_ckpt.tools._demo_job", "--rank", str(rank), "--world-size", str(world_size),
           "--port", str(port), "--out", str(out), "--steps", str(steps), "--width", str(WIDTH),
           "--save-every", str(save_every)]  # fmt: skip
    if root is not None:
        cmd += ["--root", str(root)]
    return cmd + ["--elastic"] * elastic


def fingerprint_file(out: Path, rank: int) -> dict[str, Any]:
    """What rank ``rank`` of the job run in ``out`` wrote at its end."""
    return json.loads((out / f"fingerprint-rank{rank}.json").read_text())
