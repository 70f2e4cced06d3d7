"""Acceptance test of issue 5: a killed and restarted training job ends bit for bit where an
uninterrupted one does.

The job (the demo's, through train_job.py) runs on 2 gloo ranks: an FSDP2 MLP with dropout and
per-rank seeds, a shuffling StatefulDataLoader with 2 workers, AdamW and a LambdaLR schedule,
async saves every 4 steps through CheckpointManager (keep_last=3). It is SIGKILLed (every rank
and its dataloader workers, like a lost node) several times: at random moments, and right after
``save`` returned, while the background save writes. Each restart restores the newest complete checkpoint. The final
parameters, optimizer state, scheduler state, every rank's RNG states (torch, Python, NumPy) and
its next batches must equal, bit for bit (their blake3 digests), those of the same job run once
without any manager.

The second test restarts at 1 rank from the 2-rank checkpoints the first one left.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
import torch
import train_job  # noqa: E402
from helpers.logs import logged_warnings  # noqa: E402
from helpers.trees import assert_tree_equal  # noqa: E402

from goodput_ckpt import CheckpointManager  # noqa: E402
from goodput_ckpt.errors import TopologyChangeError  # noqa: E402
from goodput_ckpt.format.manifest import MANIFEST_NAME  # noqa: E402
from goodput_ckpt.manager.step_layout import list_step_dirs  # noqa: E402
from goodput_ckpt.manager.timeline import TIMELINE_NAME, read_timeline  # noqa: E402
from goodput_ckpt.storage import open_store  # noqa: E402

# The scenario runs 6-8 two-rank job launches: 40-60 s on an idle 2-core machine.
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

STEPS = 80
SAVE_EVERY = 4
WORLD = 2
#: One job start on 2 busy cores takes 5-15 s; a whole job well under a minute.
JOB_TIMEOUT_S = 180.0


def Job(out: Path, logs: Path, root: Path | None, tag: str, elastic: bool = False) -> train_job.Job:
    """One launch of this test's 2-rank job."""
    return train_job.Job(out, logs, root, tag, world=WORLD, steps=STEPS, save_every=SAVE_EVERY, elastic=elastic)


def _complete_and_incomplete(root: Path) -> tuple[list[int], list[int]]:
    steps = list_step_dirs(open_store(str(root)))
    return (
        [s for s, f in steps.items() if MANIFEST_NAME in f],
        [s for s, f in steps.items() if MANIFEST_NAME not in f],
    )


@pytest.fixture(scope="module", params=["shuffle", "elastic"])
def resumed_job(request, tmp_path_factory):
    """Run the reference job, then the killed-and-restarted one. Returns their directories.

    ``elastic``: the loaders use ``goodput_ckpt.data.ElasticSampler`` (issue 17: same topology
    stays bit-exact with it)."""
    elastic = request.param == "elastic"
    base = tmp_path_factory.mktemp("resume")
    logs = base / "logs"
    logs.mkdir()
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    ctx = f"(kill-schedule seed {seed}; logs in {logs})"

    ref = Job(base / "ref", logs, None, "reference", elastic)
    try:
        ref.finish(time.monotonic() + JOB_TIMEOUT_S)
    except BaseException:
        ref.kill()
        raise

    root = base / "root"
    kills: list[str] = []
    try:
        mid_save_hits = 0
        # "random": after the first save of the launch, 0-4 more steps and a random delay, then
        # SIGKILL (training, a background save, a dataloader fetch, retention: whatever runs then).
        # Each launch advances at most ~9 steps, so even 8 launches leave the run unfinished.
        # "save": right after the second save of the launch returned: its write is in the background.
        plan = ["random", "save", "random", "save"]
        launch = 0
        while plan:
            kind = plan.pop(0)
            launch += 1
            job = Job(base / "managed", logs, root, f"launch{launch}-{kind}", elastic)
            deadline = time.monotonic() + JOB_TIMEOUT_S
            try:
                restored = job.wait_for("RESTORED", deadline)
                if kind == "random":
                    job.wait_for("SAVED", deadline)
                    for _ in range(rng.randint(0, 4)):  # bounded by steps, so the run cannot end first
                        job.wait_for("STEP", deadline)
                    time.sleep(rng.uniform(0.0, 0.05))
                    job.kill()
                    kills.append(f"{restored} -> killed at random after {job.log[-1]!r}")
                else:
                    job.wait_for("SAVED", deadline)
                    line = job.wait_for("SAVED", deadline)
                    job.kill()
                    step = int(line.split()[1])
                    complete, _ = _complete_and_incomplete(root)
                    hit = step not in complete  # killed before its commit: during the background save
                    mid_save_hits += hit
                    kills.append(
                        f"{restored} -> killed after {line!r} ({'mid-save' if hit else 'save had already committed'})"
                    )
                    if not hit and mid_save_hits == 0 and launch < 8:
                        plan.append("save")  # the kill came too late to catch the write: try again
            except BaseException:
                job.kill()
                raise
            complete, _ = _complete_and_incomplete(root)
            assert len(complete) <= 4, f"retention keeps 3 (4 while a deletion was cut short): {complete} {ctx}"
        assert mid_save_hits >= 1, f"no kill landed during a background save: {kills} {ctx}"

        final = Job(base / "managed", logs, root, "final", elastic)
        try:
            first = final.wait_for("RESTORED", time.monotonic() + JOB_TIMEOUT_S)
            final.finish(time.monotonic() + JOB_TIMEOUT_S)
        except BaseException:
            final.kill()
            raise
        kills.append(f"{first} -> ran to the end")
    except AssertionError as e:
        raise AssertionError(f"{e}\nlaunches so far: {kills} {ctx}") from None
    return {
        "ref": base / "ref",
        "managed": base / "managed",
        "root": root,
        "kills": kills,
        "ctx": ctx,
        "elastic": elastic,
    }


@pytest.mark.timeout(900)
def test_killed_and_restarted_job_matches_uninterrupted_run(resumed_job):
    ctx = f"{resumed_job['ctx']}; launches: {resumed_job['kills']}"
    print("launches:\n  " + "\n  ".join(resumed_job["kills"]))  # shown with -rP
    for rank in range(WORLD):
        want = train_job.fingerprint_file(resumed_job["ref"], rank)
        got = train_job.fingerprint_file(resumed_job["managed"], rank)
        assert any(k.startswith("rng.numpy") for k in want) and (rank or any(k.startswith("model.") for k in want))
        try:
            assert_tree_equal(got, want, f"rank{rank}")
        except AssertionError as e:
            raise AssertionError(f"{e} {ctx}") from None
    # The restarts really resumed (not started over) and left a clean root.
    restored = [k.split(" -> ")[0].split()[1] for k in resumed_job["kills"]]
    resumed = [int(r) for r in restored if r != "none"]
    assert restored[0] == "none" and resumed == sorted(resumed) and len(resumed) >= 3, ctx
    complete, incomplete = _complete_and_incomplete(resumed_job["root"])
    assert complete[-1] == STEPS - 1 and len(complete) == 3 and not incomplete, (complete, incomplete, ctx)
    # Every rank appended its saves and restores to the timeline, across the kills.
    records = read_timeline(resumed_job["root"] / TIMELINE_NAME)
    saved = {(r["rank"], r["step"]) for r in records if r["event"] == "save" and r["ok"]}
    assert {(rank, STEPS - 1) for rank in range(WORLD)} <= saved, ctx
    # No recorded save failed (a killed one records nothing): in particular FSDP2's forward and
    # backward never change the parameters that async staging copies behind them.
    failed = [r for r in records if r["event"] == "save" and not r["ok"]]
    assert not failed, (failed, ctx)
    restores = [r for r in records if r["event"] == "restore"]
    assert {r["rank"] for r in restores} == set(range(WORLD)) and len(restores) >= 2 * len(resumed), ctx
    assert all(r["world_size"] == WORLD and r["bytes"] > 0 for r in records), ctx


@pytest.mark.timeout(300)
def test_restart_at_one_rank_from_two_rank_checkpoint(resumed_job):
    from torchdata.stateful_dataloader import StatefulDataLoader

    if resumed_job["elastic"]:
        pytest.skip("an ElasticSampler checkpoint restores at any world size: tests/state/test_bundle_elastic.py")
    root = resumed_job["root"]
    want = train_job.fingerprint_file(resumed_job["ref"], 0)
    model = train_job.make_model(train_job.WIDTH)  # the same MLP, not sharded: one rank
    opt, sched = train_job.make_optimizer(model)
    loader = StatefulDataLoader(
        train_job.Samples(0, train_job.WIDTH), batch_size=train_job.BATCH, shuffle=True, num_workers=2
    )

    mgr = CheckpointManager(root)  # no process group: 1 rank
    with pytest.raises(TopologyChangeError) as info:
        mgr.restore(model=model, optimizer=opt, dataloader=loader, scheduler=sched)
    msg = str(info.value)
    assert "saved by 2 rank(s) and this job has 1" in msg and "rng and dataloader" in msg
    assert "allow_topology_change=True" in msg
    with pytest.raises(TopologyChangeError, match="per-rank rng state"):
        mgr.restore(model=model, optimizer=opt, scheduler=sched)  # RNG alone is refused too
    mgr.close()

    loader_before = loader.state_dict()
    torch.manual_seed(5)
    rng_before = torch.get_rng_state()
    mgr = CheckpointManager(root, allow_topology_change=True)
    with logged_warnings("skipped"):
        step = mgr.restore(model=model, optimizer=opt, dataloader=loader, scheduler=sched)
    mgr.close()
    assert step == STEPS - 1
    got = train_job.state_fingerprint(model, opt, sched)
    for part in ("model.", "optimizer.state.", "scheduler."):
        assert any(k.startswith(part) for k in got), part
        assert_tree_equal(
            {k: v for k, v in got.items() if k.startswith(part)},
            {k: v for k, v in want.items() if k.startswith(part)},
            part,
        )
    assert torch.equal(torch.get_rng_state(), rng_before), "the RNG state was kept, as the policy says"
    assert loader.state_dict() == loader_before, "the dataloader state was kept, as the policy says"
