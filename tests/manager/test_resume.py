"""Acceptance test of issue 5: a killed and restarted training job ends bit for bit where an
uninterrupted one does.

The job (train_job.py) runs on 2 gloo ranks: an FSDP2 MLP with dropout and per-rank seeds, a
shuffling StatefulDataLoader with 2 workers, AdamW and a LambdaLR schedule, async saves every 4
steps through CheckpointManager. It is SIGKILLed (every rank and its dataloader workers, like a
lost node) several times: at random moments, and right after ``save`` returned, while the
background save writes. Each restart restores the newest complete checkpoint. The final
parameters, optimizer state, scheduler state, every rank's RNG states and its next batches must
equal those of the same job run once without any manager.

The second test restarts at 1 rank from the 2-rank checkpoints the first one left.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the _dist helper
sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_job (shared model definition)
import train_job  # noqa: E402
from _trees import assert_tree_equal  # noqa: E402

from goodput_ckpt import CheckpointManager  # noqa: E402
from goodput_ckpt.errors import TopologyChangeError  # noqa: E402
from goodput_ckpt.format.manifest import MANIFEST_NAME  # noqa: E402
from goodput_ckpt.layout import list_step_dirs  # noqa: E402
from goodput_ckpt.storage import open_store  # noqa: E402
from goodput_ckpt.tools._job_launch import JobLaunch, free_port  # noqa: E402
from goodput_ckpt.timeline import TIMELINE_NAME, read_timeline  # noqa: E402

# The scenario runs 6-8 two-rank job launches: 40-60 s on an idle 2-core machine.
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

JOB = Path(train_job.__file__)
STEPS = 80
SAVE_EVERY = 4
WORLD = 2
#: One job start on 2 busy cores takes 5-15 s; a whole job well under a minute.
JOB_TIMEOUT_S = 180.0


class Job(JobLaunch):
    """One launch of the 2-rank job (the demo's launcher: each rank in its own session, so a
    SIGKILL of the session takes its dataloader workers too)."""

    def __init__(self, out: Path, logs: Path, root: Path | None, tag: str, elastic: bool = False) -> None:
        port = free_port()
        out.mkdir(parents=True, exist_ok=True)
        commands = []
        for rank in range(WORLD):
            cmd = [sys.executable, str(JOB), "--rank", str(rank), "--world-size", str(WORLD), "--port", str(port),
                   "--out", str(out), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]  # fmt: skip
            if root is not None:
                cmd += ["--root", str(root)]
            commands.append(cmd + ["--elastic"] * elastic)
        # The ranks import goodput_ckpt from this checkout, not from wherever it is installed.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(JOB.parents[2]), os.environ.get("PYTHONPATH", "")])}
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


def _complete_and_incomplete(root: Path) -> tuple[list[int], list[int]]:
    steps = list_step_dirs(open_store(str(root)))
    return ([s for s, f in steps.items() if MANIFEST_NAME in f], [s for s, f in steps.items() if MANIFEST_NAME not in f])


def _load(path: Path):
    # Our own files, written by train_job.py (they hold numpy arrays and Python RNG tuples).
    return torch.load(path, weights_only=False)


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
                    kills.append(f"{restored} -> killed after {line!r} ({'mid-save' if hit else 'save had already committed'})")
                    if not hit and mid_save_hits == 0 and launch < 8:
                        plan.append("save")  # the kill came too late to catch the write: try again
            except BaseException:
                job.kill()
                raise
            complete, _ = _complete_and_incomplete(root)
            assert len(complete) <= 3, f"retention keeps 2 (3 while a deletion was cut short): {complete} {ctx}"
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
    return {"ref": base / "ref", "managed": base / "managed", "root": root, "kills": kills, "ctx": ctx, "elastic": elastic}


@pytest.mark.timeout(900)
def test_killed_and_restarted_job_matches_uninterrupted_run(resumed_job):
    ctx = f"{resumed_job['ctx']}; launches: {resumed_job['kills']}"
    print("launches:\n  " + "\n  ".join(resumed_job["kills"]))  # shown with -rP
    for rank in range(WORLD):
        want = _load(resumed_job["ref"] / f"rank{rank}.pt")
        got = _load(resumed_job["managed"] / f"rank{rank}.pt")
        try:
            assert_tree_equal(got, want, f"rank{rank}")
        except AssertionError as e:
            raise AssertionError(f"{e} {ctx}") from None
    # The restarts really resumed (not started over) and left a clean root.
    restored = [k.split(" -> ")[0].split()[1] for k in resumed_job["kills"]]
    resumed = [int(r) for r in restored if r != "none"]
    assert restored[0] == "none" and resumed == sorted(resumed) and len(resumed) >= 3, ctx
    complete, incomplete = _complete_and_incomplete(resumed_job["root"])
    assert complete[-1] == STEPS - 1 and len(complete) == 2 and not incomplete, (complete, incomplete, ctx)
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


def _plain_model() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    w = train_job.WIDTH
    model = nn.Sequential(
        nn.Linear(w, w), nn.ReLU(), nn.Dropout(0.2), nn.Linear(w, w), nn.ReLU(), nn.Dropout(0.2), nn.Linear(w, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    return model, opt, sched


@pytest.mark.timeout(300)
def test_restart_at_one_rank_from_two_rank_checkpoint(resumed_job):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torchdata.stateful_dataloader import StatefulDataLoader

    if resumed_job["elastic"]:
        pytest.skip("an ElasticSampler checkpoint restores at any world size: tests/state/test_bundle_elastic.py")
    root = resumed_job["root"]
    want = _load(resumed_job["ref"] / "rank0.pt")
    model, opt, sched = _plain_model()
    loader = StatefulDataLoader(train_job.Samples(0), batch_size=train_job.BATCH, shuffle=True, num_workers=2)

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
    with pytest.warns(UserWarning, match="skipped"):
        step = mgr.restore(model=model, optimizer=opt, dataloader=loader, scheduler=sched)
    mgr.close()
    assert step == STEPS - 1
    assert_tree_equal(dict(model.state_dict()), dict(want["model"]), "model")
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    assert_tree_equal(osd["state"], want["optimizer"]["state"], "optimizer.state")
    assert_tree_equal(sched.state_dict(), want["scheduler"], "scheduler")
    assert torch.equal(torch.get_rng_state(), rng_before), "the RNG state was kept, as the policy says"
    assert loader.state_dict() == loader_before, "the dataloader state was kept, as the policy says"
