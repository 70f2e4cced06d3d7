"""Acceptance test of issue 18 (two tiers): a 4-rank FSDP2 job on 2 simulated nodes.

The job is the demo's (through train_job.py): an FSDP2 MLP with dropout, a shuffling
StatefulDataLoader with 2 workers per rank, AdamW and a LambdaLR schedule. It runs on 4 gloo
ranks with ``local_world_size=2`` (ranks 0-1 are node 0, ranks 2-3 node 1) and ``local_dir``
holding ``{node}``, saves every step with ``replicas=1`` and ``persist_every=3``, and stops
after step 7: steps 5-7 are on both nodes' local tiers (retention keeps 3), steps 2 and 5 are
persisted.

From that one saved state, each failure is applied to a copy and the job is restarted and run
to the end; its final parameters, optimizer and scheduler state, every rank's RNG states and
next batches must equal, bit for bit, those of the same job run once without a manager:

1. nothing lost: the newest step (7), from the local tier;
2. node 1's local directory deleted: still step 7, node 1's shards from their replicas;
3. node 1 lost and every local file on node 0 damaged: the newest persistent step (5);
4. both local directories lost: the newest persistent step (5).

``test_sigkill_during_two_tier_saves`` SIGKILLs the saving job in the background part of its
saves (the local write, the replication, the persistent upload) and checks that every restart
restores a step and that the run still ends bit for bit where the uninterrupted one does.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
import train_job

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

WORLD = 4
SAVED_STEPS = 8  # the saving run stops after step 7
STEPS = 12
JOB_TIMEOUT_S = 300.0


def _options(local: Path) -> dict:
    return {"local_dir": str(local / "node{node}"), "local_world_size": 2, "replicas": 1, "persist_every": 3}


def _run(out: Path, logs: Path, root: Path | None, tag: str, *, steps: int, local: Path | None = None) -> train_job.Job:
    job = train_job.Job(
        out, logs, root, tag, world=WORLD, steps=steps, save_every=1, options=None if local is None else _options(local)
    )
    try:
        job.finish(time.monotonic() + JOB_TIMEOUT_S)
    except BaseException:
        job.kill()
        raise
    return job


def _restored(job: train_job.Job) -> str:
    return next(line for line in job.log if line.startswith("RESTORED")).split()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiers-acceptance")
    logs = base / "logs"
    logs.mkdir()
    _run(base / "ref", logs, None, "reference", steps=STEPS)
    _run(base / "saved", logs, base / "persist", "saving", steps=SAVED_STEPS, local=base / "local")
    return base


def _prints(out: Path) -> list[dict]:
    return [train_job.fingerprint_file(out, rank) for rank in range(WORLD)]


def _damage(node_dir: Path) -> None:
    for f in node_dir.rglob("*.bin"):
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "failure, want",
    [("nothing-lost", "7"), ("node1-lost", "7"), ("node1-lost-node0-damaged", "5"), ("both-local-lost", "5")],
)
def test_two_tier_restore_is_bit_exact(runs, tmp_path, failure, want):
    assert sorted(p.name for p in (runs / "persist").glob("step_*")) == ["step_00000002", "step_00000005"]
    persist, local = tmp_path / "persist", tmp_path / "local"
    shutil.copytree(runs / "persist", persist)
    shutil.copytree(runs / "local", local)
    if failure in ("node1-lost", "node1-lost-node0-damaged"):
        shutil.rmtree(local / "node1")
    if failure == "node1-lost-node0-damaged":
        _damage(local / "node0")
    if failure == "both-local-lost":
        shutil.rmtree(local)
    job = _run(tmp_path / "out", tmp_path / "logs", persist, failure, steps=STEPS, local=local)
    assert _restored(job) == want, job.log[:3]
    assert _prints(tmp_path / "out") == _prints(runs / "ref")
    restores = [
        json.loads(line)
        for line in (persist / "goodput-timeline.jsonl").read_text().splitlines()
        if '"restore"' in line
    ]
    sources = {r["rank"]: r["sources"] for r in restores if str(r["step"]) == want}
    assert set(sources) == set(range(WORLD))
    if failure == "nothing-lost":
        assert all(set(s) == {"local"} for s in sources.values()), sources
    elif failure == "node1-lost":
        assert all(set(sources[r]) == {"local"} for r in (0, 1)), sources
        assert all("replica" in sources[r] and "persistent" not in sources[r] for r in (2, 3)), sources
    else:
        assert all("persistent" in s for s in sources.values()), sources


def _what_was_cut(persist: Path, local: Path) -> str:
    """What the kill interrupted, judged from what it left (for the failure message)."""
    cut = []
    if any(not (d / "manifest.json").exists() for d in persist.glob("step_*")):
        cut.append("a persistent upload")
    for node in (0, 1):
        for d in (local / f"node{node}").glob("job-*/step_*"):
            ranks = {f.name[:9] for f in d.glob("rank*.bin")}
            if not (d / "manifest.json").exists():
                cut.append(f"a local save or its commit on node {node}")
            elif len(ranks) < WORLD:
                cut.append(f"replication to node {node}")
    return ", ".join(sorted(set(cut))) or "nothing in flight"


@pytest.mark.timeout(900)
def test_sigkill_during_two_tier_saves(runs, tmp_path):
    """SIGKILL right after ``save`` returned, a random few ms into its background part (local
    write, replication, persistent upload), several times; every restart restores, and the run
    ends bit for bit where the uninterrupted one does."""
    seed = int.from_bytes(random.randbytes(4), "little")
    rng = random.Random(seed)
    persist, local, logs = tmp_path / "persist", tmp_path / "local", tmp_path / "logs"
    kills = []
    for launch in range(3):
        job = train_job.Job(
            tmp_path / "out",
            logs,
            persist,
            f"launch{launch}",
            world=WORLD,
            steps=STEPS,
            save_every=1,
            options=_options(local),
        )
        deadline = time.monotonic() + JOB_TIMEOUT_S
        try:
            restored = job.wait_for("RESTORED", deadline)
            for _ in range(rng.randint(2, 4)):
                line = job.wait_for("SAVED", deadline)
            time.sleep(rng.uniform(0.0, 0.03))
            job.kill()
        except BaseException:
            job.kill()
            raise
        kills.append(f"{restored} -> killed after {line!r}: {_what_was_cut(persist, local)}")
    final = _run(tmp_path / "out", logs, persist, "final", steps=STEPS, local=local)
    assert _restored(final) != "none", (kills, seed)
    assert _prints(tmp_path / "out") == _prints(runs / "ref"), (kills, seed)
