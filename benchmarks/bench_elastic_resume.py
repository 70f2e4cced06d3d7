"""Elastic data-position restore at scale: ``ElasticSampler.elastic_resume`` plus the first
``iter()`` (and its first sample) on one rank of ``--ranks`` simulated ranks, ``--samples``
samples, after ``--restarts`` restarts within one epoch, version 1 against version 2.

Rows, each measured in its own subprocess (so that one's memory does not hide another's):

- ``v1-old``: version-1 states restored by the version-1 code (``--v1-tree``: a checkout of a
  commit before version 2, e.g. ``git worktree add /tmp/v1 1b2b685``; skipped without it);
- ``v1-migrate``: the same version-1 states restored by this tree's code (converted once);
- ``v2-rows``: version-2 states, the whole record in every old rank's row (checkpoints written
  before the record moved to one job-level entry), restored by this tree's code;
- ``v2-job``: what a save writes now: each old rank's row holds its count and the record's
  digest, the record is stored once per job (``ElasticSampler.split_job_state``); the restore
  joins each row to it (``join_job_state``, timed) before ``elastic_resume``;
- ``DistributedSampler``: no restore, its first ``iter()`` + ``next()`` on the same rank (the
  baseline of the first ``iter()``: both draw the epoch's ``randperm``, which dominates; its
  "elastic_resume" column is 0).

``--rounds`` runs every row that many times, the order rotated each round; the ratio column is
each measured rank's ``elastic_resume`` + first ``iter()`` over ``DistributedSampler``'s first
``iter()`` for the same rank in the same round (min / median / max over ranks and rounds).

The old ranks' states are built in memory as a restore decodes them (one state dict per old rank;
the version-1 bitmap tensor is shared by all of them, so that the benchmark fits this machine:
a real restore decodes one copy per old rank, ``ranks`` x 1.25 MB at 10 M samples). Each row
restores ``--measure`` ranks spread over the world, one after another in its subprocess, a new
sampler each; time per rank: ``elastic_resume`` alone, and with the first ``iter()`` +
``next()`` (which draws the epoch's permutation, as ``DistributedSampler`` does every epoch);
peak extra memory: the process's peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``
before each rank) less its RSS before. Min/median/max over the measured ranks.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_elastic_resume.py --v1-tree /tmp/v1``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Ids:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(field)


def _worlds(ranks: int, restarts: int) -> list[int]:
    """Old world sizes of the stretches before the restore: the last one ``ranks``."""
    rng = random.Random(20)
    return [rng.randint(ranks // 2, ranks) for _ in range(restarts)] + [ranks]


def _states(version: int, n: int, ranks: int, restarts: int, split: bool = False) -> tuple[list[dict], dict | None]:
    """The old ranks' decoded loader states after ``restarts`` restarts (each stretch a few
    steps of batch 1 on every rank), built with the position API of the running code."""
    from goodput_ckpt.data import ElasticSampler

    worlds = _worlds(ranks, restarts)
    if version == 1:
        from goodput_ckpt.data.position import EpochPosition

        pos = EpochPosition(0)
        for w in worlds[:-1]:
            pos = pos.advanced(w, [3] * w, n)
    else:
        from goodput_ckpt.data.global_position import GlobalPosition

        pos = GlobalPosition(0)
        for w in worlds[:-1]:
            pos = pos.advanced(w, [3] * w, n)
    template = iter(ElasticSampler(Ids(n), seed=1, num_replicas=ranks, rank=0)).state_dict()
    template["position"] = pos.to_state()
    template["goodput_elastic_sampler"] = (
        version  # this tree writes version 2: a version-1 state as older code wrote it
    )
    states = [{"_sampler_iter_state": {**template, "rank": r, "consumed": 3}} for r in range(ranks)]
    if not split:
        return states, None
    parts = [ElasticSampler.split_job_state(st) for st in states]  # what a save stores
    return [row for row, _ in parts], parts[0][1]


def _measure(args) -> dict:
    import torch
    from torch.utils.data import DistributedSampler

    from goodput_ckpt.data import ElasticSampler

    torch.set_num_threads(1)
    states, job = (
        _states(args.version, args.samples, args.ranks, args.restarts, args.split) if args.version else ([], None)
    )
    picks = sorted({round(k * (args.ranks - 1) / max(1, args.measure - 1)) for k in range(args.measure)})
    out = {"resume_s": [], "first_iter_s": [], "extra_mb": []}
    for r in picks:
        # a restore decodes fresh rows (join_job_state fills them in place): not timed
        rows = [{"_sampler_iter_state": dict(st["_sampler_iter_state"])} for st in states] if job else states
        open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
        base = _kb("VmRSS")
        t0 = time.perf_counter()
        if args.version:
            s = ElasticSampler(Ids(args.samples), seed=1, num_replicas=args.ranks, rank=r)
            if job is not None:
                rows = [s.join_job_state(st, job) for st in rows]
            s.elastic_resume(rows, batch_size=2)
        else:  # the baseline: DistributedSampler, nothing to restore
            s = DistributedSampler(Ids(args.samples), num_replicas=args.ranks, rank=r, seed=1, drop_last=True)
        t1 = time.perf_counter()
        next(iter(s))
        t2 = time.perf_counter()
        out["resume_s"].append(t1 - t0)
        out["first_iter_s"].append(t2 - t0)
        out["extra_mb"].append((_kb("VmHWM") - base) / 1024)
        del s, rows
    return out


def _mmm(xs, scale, fmt) -> str:
    return " / ".join(fmt.format(scale * f(xs)) for f in (min, statistics.median, max))


def _row(name: str, got: dict, ratios: list[float]) -> str:
    return (
        f"| {name} | {len(got['resume_s'])} | {_mmm(got['resume_s'], 1e3, '{:.1f}')} | "
        f"{_mmm(got['first_iter_s'], 1e3, '{:.1f}')} | {_mmm(ratios, 1, '{:.2f}') if ratios else '-'} | "
        f"{_mmm(got['extra_mb'], 1, '{:.1f}')} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--restarts", type=int, default=20)
    ap.add_argument("--measure", type=int, default=5, help="ranks measured per row")
    ap.add_argument("--v1-tree", help="a checkout of the version-1 code, for the v1-old row")
    ap.add_argument("--rows", default="v1-old,v1-migrate,v2-rows,v2-job,DistributedSampler", help="rows to run")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every row, the order rotated")
    ap.add_argument("--split", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--version", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_measure(args)))
        return 0
    rows = [
        ("v1-old", args.v1_tree, 1, False),
        ("v1-migrate", str(REPO), 1, False),
        ("v2-rows", str(REPO), 2, False),
        ("v2-job", str(REPO), 2, True),
        ("DistributedSampler", str(REPO), 0, False),
    ]
    rows = [r for r in rows if r[0] in args.rows.split(",") and r[1] is not None]
    print(f"{args.ranks} ranks, {args.samples:,} samples, {args.restarts} restarts; load {os.getloadavg()[0]:.2f}")
    got: dict[str, list[dict]] = {name: [] for name, *_ in rows}
    for k in range(args.rounds):
        for name, tree, version, split in rows[k % len(rows) :] + rows[: k % len(rows)]:
            cmd = [sys.executable, __file__, "--child", "--version", str(version), "--ranks", str(args.ranks)]
            cmd += ["--samples", str(args.samples), "--restarts", str(args.restarts), "--measure", str(args.measure)]
            cmd += ["--split"] if split else []
            env = {**os.environ, "PYTHONPATH": tree}
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                print(f"| {name} | failed: {res.stderr.strip().splitlines()[-1:]} |")
                continue
            got[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(
        "| row | ranks x rounds | elastic_resume ms (min / median / max) | + first iter() ms | ÷ DistributedSampler's first iter() | peak extra MB |"
    )
    print("|---|---|---|---|---|---|")
    base = got.get("DistributedSampler", [])
    for name, runs in got.items():
        if not runs:
            continue
        merged = {k: [x for run in runs for x in run[k]] for k in runs[0]}
        ratios = [
            ours / theirs
            for run, ref in zip(runs, base)
            for ours, theirs in zip(run["first_iter_s"], ref["first_iter_s"])
        ]
        print(_row(name, merged, ratios), flush=True)
    print(f"load after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
