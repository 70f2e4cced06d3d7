"""``bench_scale_save.py --stream N``: the simulated ranks streamed, so that this process holds what
a real coordinator holds (its own rank's state and the payloads gathered), not W ranks' planners.

Why: ``bench_scale_save.Ranks`` keeps every rank's state dict stand-in, plan cache, planner and
writer in one process (4.6 GB at W = 1,024, about 18 GB at 4,096): W = 4,096 and 16,384 did not
fit. Here:

- The timed ranks (0: the coordinator, 1: the worst other rank, W/2: a typical rank,
  ``timed_ranks``) live in this process, exactly as in ``Ranks``: their planners are kept from
  step 1 to step 3, their plan caches from one save to the next, and their phases are timed.
- Every other rank lives in one of N worker processes (forked; rank r in worker r mod N, minus
  the timed ranks). A worker keeps, per rank, only its ``SavePlanCache`` (the rank side: a digest
  and a compact final plan, a few hundred bytes) and a copy of it as it was before the current
  save's step 1. A rank's state dict stand-ins, planner and writer are built for a step, run
  through it with the real planner and writer methods (``bench_scale_save_sim.local_step`` and
  ``write_step``, the functions ``Ranks`` runs), reduced to the bytes torch would send (the
  pickled plan, the pickled results) and dropped.
- Step 3 needs the planner of the rank's step 1 (its items): the worker replays step 1 from the
  cache copy (the same planner calls, the same plan and digest, its bytes dropped), then times
  ``finish_plan`` and the write bookkeeping alone (``process_time`` in the worker: the column
  "step 3 worst of all other ranks" covers every rank as before).
- To spare a replay, a worker runs a rank's next save's step 1 right after the rank's step 3 of
  this save (its plan kept as bytes for the next gather): the rank's own order is dcp.save's,
  and the coordinator's is unchanged (it does not read that plan before the next save's
  gather); the only difference from a real run is that it happens before the coordinator's
  commit of this save, which the rank's plan does not depend on.

Repeats: the untimed ranks' payloads of a run's first repeat (the traced one, or the first timed
one) are kept in this process, outside the coordinator's windows, and handed to the coordinator
again in the later repeats: their steps are deterministic given the coordinator's scatter, and a
repeat whose scatter differs (hashed) has them made again. For that, the writer's random tokens
(file names, ``storage_meta``'s ids) come from a generator seeded at each repeat (``tokens``), so
that each save's token is the same in every repeat. The coordinator and the timed ranks run in
full in every repeat; the untimed ranks' step-3 CPU (the "worst of all other ranks" column) is
the first repeat's in every repeat.

What the coordinator does, and how its CPU and its peak (``tracemalloc``, in the two windows of
``bench_scale_save``'s module doc) are measured, is ``bench_scale_save.one_save`` unchanged: the
same code runs on the same payloads. The workers' CPU is not this process's ``process_time``.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import multiprocessing
import os
import random
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from bench_scale_save_sim import local_step, plan_cache, planner, state_dict, timed_ranks, write_step, writer  # noqa: E402

STEP3 = "finish_plan + write bookkeeping"
BATCH = 256  # ranks per message from a worker: bounds the bytes in flight (plans: 45 KB a rank)
_MEMO: dict[tuple[Any, ...], dict[int, tuple]] = {}  # (run, step, save, scatter hash) -> rank -> payloads


class _SeededTokens:
    """``secrets``' ``token_hex`` from a seeded generator (module doc, Repeats)."""

    def __init__(self) -> None:
        self._rng = random.Random(0)

    def token_hex(self, nbytes: int = 32) -> str:
        return self._rng.randbytes(nbytes).hex()


def tokens() -> None:
    """Seed the writer's tokens for a repeat (``bench_scale_save.measure`` calls it per repeat)."""
    import goodput_ckpt.dcp.writer as writer_mod  # noqa: PLC0415

    writer_mod.secrets = _SeededTokens()  # type: ignore[assignment]


def forget_payloads() -> None:
    _MEMO.clear()


class _RankSide:
    """One worker's ranks: their plan caches between saves, nothing else."""

    def __init__(self, method: str, layout: str, world: int, root: str, ranks: list[int]) -> None:
        self.method, self.layout, self.world, self.root, self.ranks = method, layout, world, root, ranks
        self.caches = {r: plan_cache(method) for r in ranks}
        self.before: dict[int, Any] = {}  # each rank's cache as it was before this save's step 1

    def _local(self, rank: int, save: int) -> tuple[Any, bytes]:
        """Step 1 of ``rank`` on its current cache: the planner (for step 3) and the plan's bytes."""
        self.before[rank] = copy.copy(self.caches[rank])
        p = planner(self.method, self.caches[rank])
        blob = local_step(p, writer(self.method, self.root, save), state_dict(self.layout, rank, self.world), rank)
        return p, blob

    def local(self, save: int, rank: int, _scattered: bytes | None, _next: bool) -> tuple[bytes]:
        return (self._local(rank, save)[1],)

    def write(self, save: int, rank: int, scattered: bytes, next_save: bool) -> tuple[bytes, float, bytes | None]:
        """Step 3 of ``rank`` (step 1 replayed from the cache as it was), then, with ``next_save``,
        its step 1 of save ``save + 1``."""
        self.caches[rank] = copy.copy(self.before.get(rank, self.caches[rank]))  # none: a save 1 replayed alone
        p, _ = self._local(rank, save)
        c0 = time.process_time()
        results = write_step(p, self.method, scattered)
        cpu = time.process_time() - c0
        del p
        nxt = self._local(rank, save + 1)[1] if next_save else None
        return results, cpu, nxt


def _worker(conn: Any, side: _RankSide) -> None:
    gc.disable()  # as in bench_scale_save (collections only between batches, untimed)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        op, save, scattered, next_save = msg
        step = getattr(side, op)
        out = []
        for rank in side.ranks:
            out.append((rank, *step(save, rank, None if scattered is None else scattered[rank], next_save)))
            if len(out) == BATCH:
                conn.send(out)
                out = []
                gc.collect()
        conn.send(out)
        conn.send(None)


class StreamedRanks:
    """``bench_scale_save.Ranks``'s interface, with the untimed ranks in ``workers`` processes."""

    def __init__(self, method: str, layout: str, world: int, root: str, workers: int) -> None:
        self.method, self.world, self.root = method, world, root
        self.run = (method, layout, world)
        self._side = (method, layout, world, root)
        self.timed = sorted(timed_ranks(world))
        self.caches = {r: plan_cache(method) for r in self.timed}
        self.states = {r: state_dict(layout, r, world) for r in self.timed}
        self.planners: dict[int, Any] = {}
        self.writers: dict[int, Any] = {}
        self._others = [r for r in range(world) if r not in self.caches]
        self._workers = workers
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        self._next_plans: dict[int, bytes] = {}  # the untimed ranks' plans of the next save, made in step 3

    def _start(self) -> None:
        """The workers, forked when a step's payloads are not in the memo (module doc, Repeats)."""
        ctx = multiprocessing.get_context("fork")
        n = min(self._workers, len(self._others))
        for k in range(n):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(theirs, _RankSide(*self._side, self._others[k::n])))
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)

    def _run(self, op: str, save: int, scattered: list[bytes] | None, next_save: bool) -> dict[int, tuple]:
        digest = None if scattered is None else hashlib.blake2b(b"\0".join(scattered), digest_size=16).digest()
        key = (*self.run, op, save, digest, next_save)
        if key in _MEMO:
            return _MEMO[key]
        if not self._conns:
            if op == "write" and save > 1:  # the workers' caches are those of the saves before: not held
                raise RuntimeError("a later save's step 3 without its first save's in the memo")
            self._start()
        for conn in self._conns:
            conn.send((op, save, None if scattered is None else dict(enumerate(scattered)), next_save))
        out: dict[int, tuple] = {}
        pending = list(self._conns)
        while pending:  # whichever worker has a batch: one waiting on a full pipe would stall
            for conn in wait(pending):
                batch = conn.recv()
                if batch is None:
                    pending.remove(conn)
                else:
                    out.update((row[0], row[1:]) for row in batch)
        _MEMO[key] = out
        return out

    def local_step(self, save: int, timed: Callable[..., Any]) -> list[bytes]:
        blobs: list[Any] = [None] * self.world
        for r in self.timed:
            self.planners[r] = planner(self.method, self.caches[r])
            self.writers[r] = writer(self.method, self.root, save)
            blobs[r] = timed(
                r, "local plan", lambda r=r: local_step(self.planners[r], self.writers[r], self.states[r], r)
            )
        made = (
            self._next_plans
            if self._next_plans
            else {r: v[0] for r, v in self._run("local", save, None, False).items()}
        )
        for r, blob in made.items():
            blobs[r] = blob
        self._next_plans = {}
        return blobs

    def write_step(
        self, save: int, scattered: list[bytes], timed: Callable[..., Any]
    ) -> tuple[list[bytes], list[float]]:
        results: list[Any] = [None] * self.world
        cpu = [0.0] * self.world
        for r in self.timed:
            c0 = time.process_time()
            results[r] = timed(r, STEP3, lambda r=r: write_step(self.planners[r], self.method, scattered[r]))
            cpu[r] = time.process_time() - c0
        # Only a save 1 is followed by another in bench_scale_save.measure (saves 1 and 2).
        for r, (res, c, nxt) in self._run("write", save, scattered, save == 1).items():
            results[r], cpu[r] = res, c
            if nxt is not None:
                self._next_plans[r] = nxt
        return results, cpu

    def coordinator(self) -> tuple[Any, Any]:
        return self.planners[0], self.writers[0]

    def end_save(self) -> None:
        self.planners, self.writers = {}, {}

    def close(self) -> None:
        for conn in self._conns:
            conn.send(None)
        for proc in self._procs:
            proc.join(timeout=60)
        self._conns, self._procs = [], []
