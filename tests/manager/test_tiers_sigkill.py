"""SIGKILL of a two-tier job in each background phase of a save (issue 18): the local write, the
replication to the other node, the persistent upload.

The job (``tiers_job.py`` as a script: 4 gloo ranks, 2 simulated nodes, a ~50 MB replicated
model and AdamW state, every step saved, ``replicas=1``, ``persist_every=2``) runs until this
test sees, on disk, the phase it wants in progress, and SIGKILLs every rank at once (a lost
job). Then 4 fresh ranks restore: the step they agree on must reproduce, bit for bit, the
state the job had after that step, and nothing half-written may remain visible as committed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import tiers_job
from helpers.dist import run_ranks
from helpers.wait import wait_until

from goodput_ckpt.tools.demos._job_launch import JobLaunch, free_port
from goodput_ckpt.tools.ops.verify import verify_checkpoint

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

WORLD = 4
WIDTH = 2048
OPTS = {"replicas": 1, "persist_every": 2, "keep_last": 3}
PHASE_TIMEOUT_S = 240.0


def _local_write(persist: Path, local: Path) -> bool:
    """A step directory on node 0 with data files but no commit record yet."""
    return any(
        not (d / "manifest.json").exists() and any(d.glob("*.bin")) for d in (local / "node0").glob("job-*/step_*")
    )


def _replication(persist: Path, local: Path) -> bool:
    """Node 1 committed a step but has not received all of node 0's files yet."""
    for d in (local / "node1").glob("job-*/step_*"):
        if (d / "manifest.json").exists() and len(list(d.glob("rank*.bin"))) < WORLD:
            return True
    return False


def _persist(persist: Path, local: Path) -> bool:
    """A persistent step with data files but no commit record yet."""
    return any(not (d / "manifest.json").exists() and any(d.glob("*.bin")) for d in persist.glob("step_*"))


PHASES: dict[str, Callable[[Path, Path], bool]] = {
    "local-write": _local_write,
    "replication": _replication,
    "persist": _persist,
}


#: Incremental saves (issue 40): the first layer frozen, every 3rd save full, so that a persist
#: (every 2nd save) first persists the base it references, and replicas skip referenced files.
INCREMENTAL = {"incremental": 3, "freeze_first": True}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("phase,incremental", [(p, False) for p in PHASES] + [("replication", True), ("persist", True)])
def test_sigkill_in_phase(tmp_path, phase, incremental):
    opts = {**OPTS, **INCREMENTAL} if incremental else OPTS
    persist, local = tmp_path / "persist", tmp_path / "local"
    port = str(free_port())
    script = str(Path(tiers_job.__file__))
    commands = [
        [
            sys.executable,
            script,
            str(r),
            str(WORLD),
            port,
            str(persist),
            str(local / "node{node}"),
            str(WIDTH),
            json.dumps(opts),
        ]
        for r in range(WORLD)
    ]
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "logs").mkdir()
    job = JobLaunch(commands, str(tmp_path / "logs"), phase, env=env)
    seen = PHASES[phase]
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    try:
        saved = 0
        while saved < 2:  # two saves returned: there is something to restore
            line = job.next_line(deadline)
            assert line is not None, f"the job ended before its second save{job.why()}"
            saved += line.startswith("SAVED")
        wait_until(
            lambda: seen(persist, local),
            max(0.0, deadline - time.monotonic()),
            interval=0.0005,
            what=f"the {phase} phase in progress (within {PHASE_TIMEOUT_S:.0f} s of the start)",
        )
    finally:
        job.kill()

    run_ranks(
        tiers_job.restore_step,
        WORLD,
        str(persist),
        str(local / "node{node}"),
        opts,
        str(tmp_path),
        WIDTH,
        report_dir=tmp_path / "report",
    )
    results = [json.loads((tmp_path / f"restored-rank{r}.json").read_text()) for r in range(WORLD)]
    step = results[0]["step"]
    assert step is not None and all(r["step"] == step and r["error"] is None for r in results)
    want = tiers_job.reference_digest(step + 1, WIDTH, incremental)
    assert all(r["digest"] == want for r in results)
    # what the kill left half-written is not taken for a checkpoint, and was cleaned up
    assert not _persist(persist, local)
    assert all((d / "manifest.json").exists() for d in persist.glob("step_*"))
    # every persisted step is whole, the files it references in its bases included
    assert all(verify_checkpoint(str(d)).ok for d in persist.glob("step_*"))
