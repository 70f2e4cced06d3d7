"""Job identity (issue 32): a restore uses only its own job's steps, on every tier, and
``persist_every`` counts saves across restarts (``goodput_ckpt.manager.job``).

One-process cases use a two-tier manager with one node; the acceptance case at the end runs 4
gloo ranks on 2 simulated nodes, SIGKILLed every 2 saves over 6 restarts.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import tiers_job
from helpers.dist import run_ranks

from goodput_ckpt import CheckpointManager
from goodput_ckpt.errors import CheckpointError
from goodput_ckpt.format.commit_record import read_commit_record
from goodput_ckpt.manager.job import JOB_FILE, JobRecord, job_of
from goodput_ckpt.manager.step_layout import step_dir_name
from goodput_ckpt.storage import open_store
from goodput_ckpt.tools.demos._job_launch import JobLaunch, free_port

TIERS_LOG = "goodput_ckpt.tiers"


def _save(root: Path, local: Path, steps: range, **opts) -> str:
    """Train and save ``steps`` with a one-node two-tier manager; the job's id."""
    model, opt = tiers_job.make(0)
    opts = {"persist_every": 2, "keep_last": 2, "async_save": False, **opts}
    with CheckpointManager(root, local_dir=str(local), **opts) as mgr:
        if steps.start:
            assert mgr.restore(model=model, optimizer=opt) == steps.start - 1
        for step in steps:
            tiers_job.train(model, opt, step)
            mgr.save(step, model=model, optimizer=opt)
        mgr.wait()
        return mgr.job_id


def _restore(root: Path, local: Path, **opts) -> tuple[int | None, dict, dict]:
    model, opt = tiers_job.make(0)
    with CheckpointManager(root, local_dir=str(local), persist_every=2, **opts) as mgr:
        step = mgr.restore(model=model, optimizer=opt)
        sources = mgr.timeline[-1]["sources"] if step is not None else {}
    return step, tiers_job.digest(model, opt), sources


def _job_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == TIERS_LOG and "other jobs" in r.getMessage()]


def test_another_job_on_the_same_local_dir_starts_fresh_and_leaves_it_alone(tmp_path, caplog):
    """Job B (a new root) on job A's ``local_dir``: nothing of A's is restored, one warning
    names A's directory, B's retention never deletes it; A restarted on its own root restores
    its newest step from the local tier, bit for bit."""
    local = tmp_path / "local"
    a = _save(tmp_path / "root-a", local, range(4))  # steps 0-3, 1 and 3 persisted
    a_steps = sorted(p.name for p in (local / f"job-{a}").glob("step_*"))
    assert a_steps == ["step_00000002", "step_00000003"]
    caplog.clear()
    step, _, _ = _restore(tmp_path / "root-b", local)
    assert step is None
    (warned,) = _job_warnings(caplog)
    assert f"job-{a}" in warned and str(local) in warned
    b = _save(tmp_path / "root-b", local, range(5), local_keep_last=1)  # B's retention runs 5 times
    assert b != a
    assert sorted(p.name for p in (local / f"job-{a}").glob("step_*")) == a_steps  # untouched
    step, digest, sources = _restore(tmp_path / "root-a", local)
    assert step == 3 and sources == {"local": 1}
    assert digest == tiers_job.reference_digest(4)


def test_a_wiped_root_is_a_new_job(tmp_path):
    """The persistent root deleted while the node-local copies remain: the next manager on that
    path is a new job, and restores nothing (the local steps are the old job's)."""
    local = tmp_path / "local"
    old = _save(tmp_path / "root", local, range(3))
    shutil.rmtree(tmp_path / "root")
    with CheckpointManager(tmp_path / "root", local_dir=str(local), persist_every=2) as mgr:
        assert mgr.job_id != old
        model, opt = tiers_job.make(0)
        assert mgr.restore(model=model, optimizer=opt) is None
    assert (local / f"job-{old}" / "step_00000002" / "manifest.json").exists()


def test_a_copied_local_step_of_another_job_is_refused(tmp_path):
    """A node-local step whose commit record names another job (copied in by hand) is never
    restored, and the error says why."""
    local = tmp_path / "local"
    a = _save(tmp_path / "root-a", local, range(2), persist_every=5)  # nothing persisted
    b = _save(tmp_path / "root-b", local, range(1), persist_every=5)
    shutil.copytree(local / f"job-{a}" / "step_00000001", local / f"job-{b}" / "step_00000001")
    model, opt = tiers_job.make(0)
    with CheckpointManager(tmp_path / "root-b", local_dir=str(local), persist_every=5) as mgr:
        with pytest.raises(CheckpointError, match=f"another job \\({a}\\)"):
            mgr.restore(1, model=model, optimizer=opt)
        assert mgr.restore(model=model, optimizer=opt) == 0  # its own step


def test_every_record_names_its_job_and_save_number(tmp_path):
    """Each commit record carries the job's id and its save number, which counts on across a
    restart; a one-tier manager records the job too."""
    model, opt = tiers_job.make(0)
    root = tmp_path / "root"
    with CheckpointManager(root, async_save=False) as mgr:
        job = mgr.job_id
        for step in (10, 20):
            mgr.save(step, model=model, optimizer=opt)
    with CheckpointManager(root, async_save=False) as mgr:
        assert mgr.job_id == job
        assert mgr.restore(model=model, optimizer=opt) == 20
        mgr.save(30, model=model, optimizer=opt)
    store = open_store(str(root), {})
    for step, save in ((10, 1), (20, 2), (30, 3)):
        record = read_commit_record(store, step_dir_name(step))
        assert job_of(record.manifest, record.uri) == JobRecord(job, save)
    assert json.loads((root / JOB_FILE).read_text())["id"] == job


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b'{"format": "something else"}',
        b'{"format": "goodput-ckpt job", "version": 9}',
        b'{"format": "goodput-ckpt job", "version": 1, "id": "../../x"}',
        b"x" * 5000,
    ],
)
def test_a_job_file_that_is_not_ours_is_refused(tmp_path, content):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / JOB_FILE).write_bytes(content)
    with pytest.raises(CheckpointError, match=JOB_FILE):
        CheckpointManager(tmp_path / "root")


def test_persist_every_counts_saves_across_restarts(tmp_path):
    """``persist_every=3`` with each process making 2 saves: the count goes on across processes
    (before, every process started it at 0 and nothing was ever persisted), so losing every
    node-local copy loses at most 2 saves."""
    root, local = tmp_path / "root", tmp_path / "local"
    for run in range(4):  # steps 0-7, two per process
        _save(root, local, range(2 * run, 2 * run + 2), persist_every=3, keep_last=3)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000005"]
    shutil.rmtree(local)
    step, digest, sources = _restore(root, local)
    assert step == 5 and sources == {"persistent": 1}
    assert digest == tiers_job.reference_digest(6)


def test_a_failed_persist_makes_the_next_save_persist(tmp_path, monkeypatch):
    """A persist that fails does not wait ``persist_every`` more saves: the next save goes."""
    from goodput_ckpt.manager.tiers import persist

    real = persist.copy_file
    calls = {"n": 0}

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(persist, "copy_file", failing_once)
    root, local = tmp_path / "root", tmp_path / "local"
    model, opt = tiers_job.make(0)
    failed = []
    with CheckpointManager(root, local_dir=str(local), persist_every=3, keep_last=3, async_save=False) as mgr:
        for step in range(4):
            tiers_job.train(model, opt, step)
            mgr.save(step, model=model, optimizer=opt)
            try:
                mgr.wait()  # and the persist of this save, if any, before the next save decides
            except CheckpointError as e:
                failed.append((step, str(e)))
    assert [s for s, _ in failed] == [2] and "No space left" in failed[0][1]
    assert sorted(p.parent.name for p in root.glob("step_*/manifest.json")) == ["step_00000003"]  # 2 left incomplete


# -- acceptance: 4 ranks on 2 simulated nodes, SIGKILL every 2 saves over 6 restarts ------------

WORLD = 4
RUNS = 6
RUN_TIMEOUT_S = 240.0


def _newest_committed(local: Path) -> int:
    steps = [int(d.name.split("_")[1]) for d in local.glob("node*/job-*/step_*") if (d / "manifest.json").exists()]
    return max(steps)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sigkill_every_two_saves_loses_at_most_persist_every_minus_one(tmp_path):
    persist, local = tmp_path / "persist", tmp_path / "local"
    opts = {"replicas": 1, "persist_every": 3, "keep_last": 3, "async_save": False, "resume": True}
    script = str(Path(tiers_job.__file__))
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "logs").mkdir()
    for run in range(RUNS):
        port = str(free_port())
        commands = [
            [
                sys.executable,
                script,
                str(r),
                str(WORLD),
                port,
                str(persist),
                str(local / "node{node}"),
                "64",
                json.dumps(opts),
            ]
            for r in range(WORLD)
        ]
        job = JobLaunch(commands, str(tmp_path / "logs"), f"run{run}", env=env)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        try:
            saved = 0
            while saved < 2 * WORLD:  # every rank's save() returned twice: two committed saves
                line = job.next_line(deadline)
                assert line is not None, f"run {run} ended before its second save{job.why()}"
                saved += line.startswith("SAVED")
        finally:
            job.kill()  # SIGKILL, every rank at once
    newest = _newest_committed(local)
    assert newest >= 2 * RUNS - 1
    shutil.rmtree(local)  # every node lost
    run_ranks(
        tiers_job.restore_step,
        WORLD,
        str(persist),
        str(local / "node{node}"),
        {"persist_every": 3, "replicas": 1},
        str(tmp_path),
        report_dir=tmp_path / "report",
    )
    results = [json.loads((tmp_path / f"restored-rank{r}.json").read_text()) for r in range(WORLD)]
    step = results[0]["step"]
    assert step is not None and all(r["step"] == step and r["error"] is None for r in results)
    assert newest - step <= 2, (
        f"restored step {step}, newest committed {newest}: more than persist_every - 1 saves lost"
    )
    assert all(r["digest"] == tiers_job.reference_digest(step + 1) for r in results)
