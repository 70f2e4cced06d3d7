"""Elastic data-position restore at scale: ``ElasticSampler.elastic_resume`` plus the first
``iter()`` (and its first sample) on one rank of ``--ranks`` simulated ranks, ``--samples``
samples, after ``--restarts`` restarts within one epoch, version 1 against version 2.

Rows, each measured in its own subprocess (so that one's memory does not hide another's):

- ``v1-old``: version-1 states restored by the version-1 code (``--v1-tree``: a checkout of a
  commit before version 2, e.g. ``git worktree add /tmp/v1 1b2b685``; skipped without it);
- ``v1-migrate``: the same version-1 states restored by this tree's code (converted once);
- ``v2``: version-2 states (one fixed-size record per job) restored by this tree's code;
- ``DistributedSampler``: no restore, its first ``iter()`` + ``next()`` on the same rank (the
  baseline of the first ``iter()``: both draw the epoch's ``randperm``, which dominates; its
  "elastic_resume" column is 0).

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


def _states(version: int, n: int, ranks: int, restarts: int) -> list[dict]:
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
    return [{"_sampler_iter_state": {**template, "rank": r, "consumed": 3}} for r in range(ranks)]


def _measure(args) -> dict:
    import torch
    from torch.utils.data import DistributedSampler

    from goodput_ckpt.data import ElasticSampler

    torch.set_num_threads(1)
    states = _states(args.version, args.samples, args.ranks, args.restarts) if args.version else []
    picks = sorted({round(k * (args.ranks - 1) / max(1, args.measure - 1)) for k in range(args.measure)})
    out = {"resume_s": [], "first_iter_s": [], "extra_mb": []}
    for r in picks:
        open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
        base = _kb("VmRSS")
        t0 = time.perf_counter()
        if args.version:
            s = ElasticSampler(Ids(args.samples), seed=1, num_replicas=args.ranks, rank=r)
            s.elastic_resume(states, batch_size=2)
        else:  # the baseline: DistributedSampler, nothing to restore
            s = DistributedSampler(Ids(args.samples), num_replicas=args.ranks, rank=r, seed=1, drop_last=True)
        t1 = time.perf_counter()
        next(iter(s))
        t2 = time.perf_counter()
        out["resume_s"].append(t1 - t0)
        out["first_iter_s"].append(t2 - t0)
        out["extra_mb"].append((_kb("VmHWM") - base) / 1024)
        del s
    return out


def _row(name: str, got: dict) -> str:
    def mmm(xs, scale, fmt):
        return " / ".join(fmt.format(scale * f(xs)) for f in (min, statistics.median, max))

    return (
        f"| {name} | {len(got['resume_s'])} | {mmm(got['resume_s'], 1e3, '{:.1f}')} | "
        f"{mmm(got['first_iter_s'], 1e3, '{:.1f}')} | {mmm(got['extra_mb'], 1, '{:.1f}')} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--restarts", type=int, default=20)
    ap.add_argument("--measure", type=int, default=5, help="ranks measured per row")
    ap.add_argument("--v1-tree", help="a checkout of the version-1 code, for the v1-old row")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--version", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_measure(args)))
        return 0
    rows = [
        ("v1-old", args.v1_tree, 1),
        ("v1-migrate", str(REPO), 1),
        ("v2", str(REPO), 2),
        ("DistributedSampler", str(REPO), 0),
    ]
    print(f"{args.ranks} ranks, {args.samples:,} samples, {args.restarts} restarts; load {os.getloadavg()[0]:.2f}")
    print("| row | ranks measured | elastic_resume ms (min / median / max) | + first iter() ms | peak extra MB |")
    print("|---|---|---|---|---|")
    for name, tree, version in rows:
        if tree is None:
            continue
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--version",
            str(version),
            "--ranks",
            str(args.ranks),
            "--samples",
            str(args.samples),
            "--restarts",
            str(args.restarts),
            "--measure",
            str(args.measure),
        ]
        env = {**os.environ, "PYTHONPATH": tree}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            print(f"| {name} | failed: {res.stderr.strip().splitlines()[-1:]} |")
            continue
        print(_row(name, json.loads(res.stdout.strip().splitlines()[-1])), flush=True)
    print(f"load after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
