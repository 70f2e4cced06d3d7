"""Acceptance test of issue 17: an elastic restart loses and repeats no sample.

A DDP job on gloo (elastic_job.py: ElasticSampler + StatefulDataLoader, per-sample augmentation
from ``sample_generator``) is SIGKILLed at random moments (every rank and its dataloader workers)
and restarted at 4 -> 3 -> 2 -> 4 ranks with ``num_workers`` 2, 0, 2, 0; the last launch runs to
the end, across several epochs. Every rank logs the sample ids of every step it trains. A step
redone after a restore counts once: the record of a step is the one of the last launch that
trained it (an earlier launch's record of it was never committed). Per epoch: no id twice, and
at most one partial global batch missing. Every sample's input equals its augmentation computed
here from (seed, epoch, index), whichever rank and worker produced it.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import elastic_job  # noqa: E402

from goodput_ckpt.tools._job_launch import JobLaunch, free_port  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

JOB = Path(elastic_job.__file__)
REPO = JOB.parents[2]
STEPS = 40
SAVE_EVERY = 3
#: (world size, num_workers) of the launches; the last one runs to the end.
LAUNCHES = [(4, 2), (3, 0), (2, 2), (4, 0)]
JOB_TIMEOUT_S = 240.0


def _launch(root: Path, log: Path, logs: Path, tag: str, ws: int, workers: int) -> JobLaunch:
    port = free_port()
    cmds = [
        [sys.executable, str(JOB), "--rank", str(r), "--world-size", str(ws), "--port", str(port),
         "--workers", str(workers), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
         "--root", str(root), "--log", str(log), "--tag", tag]
        for r in range(ws)
    ]  # fmt: skip
    # The job imports goodput_ckpt from this checkout, whatever the installed one is.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return JobLaunch(cmds, str(logs), tag, env=env)


def _wait_for(job: JobLaunch, prefix: str, deadline: float, seen: list[str]) -> str:
    while True:
        line = job.next_line(deadline)
        if line is None:
            raise AssertionError(f"{job.tag}: rank 0 exited before {prefix!r}; output ends {seen[-5:]}{job.why()}")
        seen.append(line)
        if line.startswith(prefix):
            return line


def _records(log: Path) -> list[tuple[int, int, int, int, int, list[tuple[int, str]]]]:
    """(launch, step, epoch, rank, world size, [(id, hex)]) per line; a line cut by a kill is skipped
    (its step was logged before its save, so it was not committed and is redone)."""
    out = []
    for line in log.read_text().splitlines():
        parts = line.split()
        try:
            launch, step, epoch, rank, ws = (int(p) for p in parts[:5])
            items = [(int(i), h) for i, h in (p.split(":") for p in parts[5:])]
            [float.fromhex(h) for _, h in items]
        except ValueError:
            continue
        out.append((launch, step, epoch, rank, ws, items))
    return out


@pytest.mark.timeout(900)
def test_elastic_restarts_lose_and_repeat_no_sample(tmp_path):
    root, log, logs = tmp_path / "root", tmp_path / "ids.log", tmp_path / "logs"
    logs.mkdir()
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    history: list[str] = []
    ctx = lambda: f"(kill-schedule seed {seed}; launches {history}; logs in {logs})"  # noqa: E731
    for n, (ws, workers) in enumerate(LAUNCHES):
        job = _launch(root, log, logs, str(n), ws, workers)
        seen: list[str] = []
        deadline = time.monotonic() + JOB_TIMEOUT_S
        try:
            restored = _wait_for(job, "RESTORED", deadline, seen)
            if n < len(LAUNCHES) - 1:
                _wait_for(job, "SAVED", deadline, seen)
                for _ in range(rng.randint(0, 4)):  # at most 3 + 4 steps: the run cannot end first
                    _wait_for(job, "STEP", deadline, seen)
                time.sleep(rng.uniform(0.0, 0.05))
                job.kill()
                history.append(f"{ws} ranks/{workers} workers: {restored}, killed after {seen[-1]!r}")
            else:
                _wait_for(job, "DONE", deadline, seen)
                job.finish(deadline)
                history.append(f"{ws} ranks/{workers} workers: {restored}, ran to the end")
        except BaseException:
            job.kill()
            raise
        assert n == 0 or restored != "RESTORED none", ctx()

    # The record of a step: that of the last launch that trained it, from every one of its ranks.
    records = _records(log)
    last_launch: dict[int, int] = {}
    for launch, step, *_ in records:
        last_launch[step] = max(launch, last_launch.get(step, -1))
    assert sorted(last_launch) == list(range(STEPS)), ctx()
    by_epoch: dict[int, list[int]] = defaultdict(list)
    global_batch: dict[int, int] = defaultdict(int)
    ranks: dict[int, set[int]] = defaultdict(set)
    for launch, step, epoch, rank, ws, items in records:
        if launch != last_launch[step]:
            continue
        ranks[step].add(rank)
        for i, h in items:
            want = elastic_job.augmentation(epoch, i).sum()
            assert float.fromhex(h) == float(want), f"sample {i} of epoch {epoch}: another augmentation {ctx()}"
            by_epoch[epoch].append(i)
        global_batch[epoch] = max(global_batch[epoch], elastic_job.BATCH * ws)
    for step, rs in ranks.items():
        ws = LAUNCHES[last_launch[step]][0]
        assert rs == set(range(ws)), f"step {step}: ranks {sorted(rs)} of {ws} logged it {ctx()}"
    assert len(by_epoch) >= 2, f"the run crossed no epoch boundary {ctx()}"
    *finished, _ = sorted(by_epoch)  # the last epoch was cut by the end of the run
    for epoch in finished:
        ids = by_epoch[epoch]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        assert not dup, f"epoch {epoch}: samples {dup} trained twice {ctx()}"
        missing = sorted(set(range(elastic_job.N)) - set(ids))
        assert len(missing) < global_batch[epoch], f"epoch {epoch}: samples {missing} never trained {ctx()}"
    ids = by_epoch[max(by_epoch)]
    assert len(ids) == len(set(ids)), f"last epoch: a sample twice {ctx()}"
    print("launches:\n  " + "\n  ".join(history))
