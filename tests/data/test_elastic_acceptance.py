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

import elastic_job  # noqa: E402
import numpy as np
import pytest

from goodput_ckpt.tools.demos._job_launch import JobLaunch, free_port  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

JOB = Path(elastic_job.__file__)
REPO = JOB.parents[2]
STEPS = 40
SAVE_EVERY = 3
#: (world size, num_workers) of the launches; the last one runs to the end.
LAUNCHES = [(4, 2), (3, 0), (2, 2), (4, 0)]
JOB_TIMEOUT_S = 240.0


def _launch(
    root: Path, log: Path, logs: Path, tag: str, ws: int, workers: int, tokens: Path | None, *, steps: int, batch: int
) -> JobLaunch:
    port = free_port()
    cmds = [
        [
            sys.executable,
            str(JOB),
            "--rank",
            str(r),
            "--world-size",
            str(ws),
            "--port",
            str(port),
            "--workers",
            str(workers),
            "--steps",
            str(steps),
            "--save-every",
            str(SAVE_EVERY),
            "--batch",
            str(batch),
            "--root",
            str(root),
            "--log",
            str(log),
            "--tag",
            tag,
            *(["--tokens", str(tokens)] if tokens else []),
        ]
        for r in range(ws)
    ]
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


def _run_launches(tmp_path: Path, tokens: Path | None = None, *, launches=LAUNCHES, steps=STEPS, seed=None):
    """The launches (all but the last killed at random, the last to the end); ``launches``:
    (world size, workers[, per-rank batch]); ``seed``: of the kill schedule (random if None).
    Returns (records of the steps that count, per step; a function giving the context for messages)."""
    root, log, logs = tmp_path / "root", tmp_path / "ids.log", tmp_path / "logs"
    logs.mkdir()
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    rng = random.Random(seed)
    history: list[str] = []
    ctx = lambda: f"(kill-schedule seed {seed}; launches {history}; logs in {logs})"  # noqa: E731
    for n, (ws, workers, *batch) in enumerate(launches):
        job = _launch(
            root, log, logs, str(n), ws, workers, tokens, steps=steps, batch=batch[0] if batch else elastic_job.BATCH
        )
        seen: list[str] = []
        deadline = time.monotonic() + JOB_TIMEOUT_S
        try:
            restored = _wait_for(job, "RESTORED", deadline, seen)
            if n < len(launches) - 1:
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

    print("launches:\n  " + "\n  ".join(history))
    # The record of a step: that of the last launch that trained it, from every one of its ranks.
    records = _records(log)
    last_launch: dict[int, int] = {}
    for launch, step, *_ in records:
        last_launch[step] = max(launch, last_launch.get(step, -1))
    assert sorted(last_launch) == list(range(steps)), ctx()
    kept = [r for r in records if r[0] == last_launch[r[1]]]
    ranks: dict[int, set[int]] = defaultdict(set)
    for _, step, _, rank, _, _ in kept:
        ranks[step].add(rank)
    for step, rs in ranks.items():
        ws = launches[last_launch[step]][0]
        assert rs == set(range(ws)), f"step {step}: ranks {sorted(rs)} of {ws} logged it {ctx()}"
    return kept, ctx


@pytest.mark.timeout(900)
def test_elastic_restarts_lose_and_repeat_no_sample(tmp_path):
    kept, ctx = _run_launches(tmp_path)
    by_epoch: dict[int, list[int]] = defaultdict(list)
    global_batch: dict[int, int] = defaultdict(int)
    for _, _, epoch, _, ws, items in kept:
        for i, h in items:
            want = elastic_job.augmentation(epoch, i).sum()
            assert float.fromhex(h) == float(want), f"sample {i} of epoch {epoch}: another augmentation {ctx()}"
            by_epoch[epoch].append(i)
        global_batch[epoch] = max(global_batch[epoch], elastic_job.BATCH * ws)
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


#: Token shards: many, so that no (rank, worker) runs out within STEPS after any re-deal.
TOKEN_SHARDS, TOKEN_SEQS = 48, 20


@pytest.mark.timeout(900)
def test_token_stream_restarts_read_no_sequence_twice_and_skip_none(tmp_path):
    """The same launches with a TokenStream loader: what was trained of each shard is a prefix of
    it (nothing skipped), and no sequence was trained twice."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(TOKEN_SHARDS):
        a = np.zeros((TOKEN_SEQS, 1 + elastic_job.DIM), dtype=np.uint32)
        a[:, 0] = np.arange(k * TOKEN_SEQS, (k + 1) * TOKEN_SEQS)
        a[:, 1:] = (a[:, :1] * 7 + np.arange(1, 1 + elastic_job.DIM)) % 1000
        (shards / f"shard{k:03d}.bin").write_bytes(a.tobytes())
    kept, ctx = _run_launches(tmp_path, shards)
    ids = [i for *_, items in kept for i, _ in items]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    assert not dup, f"sequences {dup} trained twice {ctx()}"
    for k in range(TOKEN_SHARDS):
        got = sorted(i - k * TOKEN_SEQS for i in ids if i // TOKEN_SEQS == k)
        assert got == list(range(len(got))), f"shard {k}: sequences {got} are not a prefix (one skipped) {ctx()}"


#: 4 -> 3 -> 2 -> 4 ranks with per-rank batches 3, 4, 6, 3: a global batch of 12 throughout.
CONSTANT_GLOBAL = [(4, 2, 3), (3, 0, 4), (2, 2, 6), (4, 0, 3)]
CONSTANT_STEPS = 25


@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", [34])
def test_a_constant_global_batch_draws_the_uninterrupted_runs_global_batches(tmp_path, seed):
    """Issue 34's acceptance: killed at seeded moments and restarted at 4 -> 3 -> 2 -> 4 ranks
    with the global batch kept at 12, the job trains, step by step, the very global batches
    (the set of samples over all ranks) that an uninterrupted 4-rank run draws
    (``DistributedSampler``'s shares of each epoch, batch 3)."""
    import torch
    from torch.utils.data import DistributedSampler

    kept, ctx = _run_launches(tmp_path, launches=CONSTANT_GLOBAL, steps=CONSTANT_STEPS, seed=seed)
    got: dict[int, tuple[int, set[int]]] = {}
    for _, step, epoch, _, _, items in kept:
        e, ids = got.setdefault(step, (epoch, set()))
        assert e == epoch, f"step {step}: ranks in epochs {e} and {epoch} {ctx()}"
        ids.update(i for i, _ in items)
    ds = torch.utils.data.TensorDataset(torch.arange(elastic_job.N))
    want: list[tuple[int, set[int]]] = []
    for epoch in range(CONSTANT_STEPS):
        shares = []
        for r in range(4):
            ds_sampler = DistributedSampler(ds, num_replicas=4, rank=r, shuffle=True, seed=0, drop_last=True)
            ds_sampler.set_epoch(epoch)
            shares.append(list(ds_sampler))
        for k in range(len(shares[0]) // 3):
            want.append((epoch, {i for share in shares for i in share[3 * k : 3 * k + 3]}))
        if len(want) >= CONSTANT_STEPS:
            break
    for step in range(CONSTANT_STEPS):
        assert got[step] == want[step], f"step {step}: {sorted(got[step][1])} != {sorted(want[step][1])} {ctx()}"
