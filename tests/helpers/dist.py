"""Run a function on N real processes joined in a gloo process group (for multi-rank tests).

Starting a process group costs 10-30 s on 2 cores, so a test runs many checks inside one
worker function instead of one group per check. Every rank that fails reports its full
traceback in the ``AssertionError`` raised here, so pytest shows what went wrong on each rank.

Why the parent watches the ranks itself (instead of ``torch.multiprocessing.spawn``): when one
rank raises, the others usually block in a collective until gloo's timeout. The parent gives
them a short grace period, then kills them (by PID, only processes it started), and reports
every traceback, not just the first one. A rank that is still running when it is killed first
dumps the stacks of all its threads (``faulthandler`` on SIGUSR1), so a hang shows where it hung.
Each rank leads its own process group, so killing it also ends what it started (the background
process of ``dcp.async_save``'s process executor).

The parent hosts the rendezvous ``TCPStore`` on a port the kernel picks, so no other process can
take the port between choosing and binding it.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_ranks"]

#: After one rank fails, how long the others get to finish or fail on their own.
_GRACE_S = 15.0
#: Rendezvous and collective timeout inside the ranks; the parent's ``timeout`` bounds the whole run.
_PG_TIMEOUT = datetime.timedelta(seconds=120)


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, report_dir: str, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.setpgid(0, 0)  # see _kill
    stacks = open(Path(report_dir, f"rank{rank}.stacks"), "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2-3 ranks share 2 cores
    ok = False
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_PG_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=_PG_TIMEOUT)
        fn(rank, world_size, *args)
        dist.barrier()
        ok = True
    except BaseException:  # noqa: BLE001 - CheckpointException is a BaseException
        Path(report_dir, f"rank{rank}.txt").write_text(traceback.format_exc())
    finally:
        if ok and dist.is_initialized():
            dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


def _kill(p: mp.process.BaseProcess) -> None:
    """SIGKILL a rank and every process it started (its own process group)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:  # it has not called setpgid yet, or is gone
        p.kill()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    report_dir: str | os.PathLike,
    timeout: float = 240.0,
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes with gloo.

    ``fn`` must be importable by the children (a module-level function) and ``args`` picklable.
    Each rank has ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` (the parent's store) set, and
    the default process group initialized before ``fn`` runs.

    Raises:
        AssertionError: a rank raised, exited non-zero or ran past ``timeout``; the message holds
            every failing rank's traceback.
    """
    __tracebackhide__ = True
    report = Path(report_dir)
    report.mkdir(parents=True, exist_ok=True)
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_PG_TIMEOUT)
    port = store.port
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, str(report), args), name=f"rank{r}")
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    killed: dict[int, str] = {}
    try:
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            limit = deadline if failed_at is None else min(deadline, failed_at + _GRACE_S)
            if now >= limit:
                why = "another rank failed" if failed_at is not None else f"timeout of {timeout:.0f}s"
                hung = [(r, p) for r, p in enumerate(procs) if p.is_alive()]
                for _, p in hung:
                    os.kill(p.pid, signal.SIGUSR1)
                time.sleep(1.0)  # let faulthandler write the stacks
                for r, p in hung:
                    _kill(p)
                    killed[r] = why
                break
            time.sleep(0.1)
    finally:
        for r, p in enumerate(procs):
            if p.is_alive():
                _kill(p)
                killed.setdefault(r, "test interrupted")
            p.join(10)
        del store

    problems = []
    for r, p in enumerate(procs):
        tb_file = report / f"rank{r}.txt"
        if tb_file.exists():
            problems.append(f"--- rank {r} raised:\n{tb_file.read_text()}")
        elif r in killed:
            stacks_file = report / f"rank{r}.stacks"
            stacks = stacks_file.read_text() if stacks_file.exists() else ""
            problems.append(f"--- rank {r} killed ({killed[r]}) while still running; its stacks:\n{stacks}")
        elif p.exitcode != 0:
            problems.append(f"--- rank {r} exited with code {p.exitcode} (no traceback; see captured output)")
    if problems:
        raise AssertionError(
            f"{fn.__name__} failed on {len(problems)} of {world_size} rank(s):\n" + "\n".join(problems)
        )
