"""One repeat of one method of ``bench``: the timed save, load and verify, and the stall of an
async save, each by the shared procedure of :mod:`._bench_measure`; a failure of torch's
method turns it into ``n/a`` with the reason (goodput's own failures are raised).

Split from :mod:`.bench` (which runs the repeats in rotating order, checks the machine and
builds the report) so that each reads in one screen; the procedure itself is described in
:mod:`.bench`'s docstring.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable

from ...errors import CheckpointError, CorruptCheckpointError
from ._bench_measure import Load, save_and_load, wait_quiet
from ._bench_methods import BenchMethod, is_save_or_load_failure, wait_durable
from ._bench_report import GB, SAMPLES, MethodResult
from ._bench_scratch import Scratch

__all__ = ["save_load_or_give_up", "stall_or_give_up"]


def save_load_or_give_up(
    m: BenchMethod,
    res: MethodResult,
    state,
    dest,
    scratch: Scratch,
    rep: int,
    repeats: int,
    *,
    keep: bool,
    quiet: float,
    colds: list,
    say: Callable[[str], None],
) -> None:
    """:func:`_save_load`; a failure of torch's method makes it ``n/a`` (goodput's is raised)."""
    where = f"[{rep + 1}/{repeats}] {m.name}"
    say(f"{where}: save, load" + (", verify" if m.verify else ""))
    if _give_up_on_failure(
        m,
        res,
        scratch,
        rep,
        where,
        say,
        lambda: _save_load(m, res, state, dest, scratch, rep, check=rep == 0, keep=keep, quiet=quiet, colds=colds),
    ):
        return
    say(f"{where}: {_summary_line(res)}")


def stall_or_give_up(
    m: BenchMethod,
    res: MethodResult,
    state,
    scratch: Scratch,
    rep: int,
    repeats: int,
    *,
    quiet: float,
    say: Callable[[str], None],
) -> None:
    """:func:`_stall`; a failure of torch's method makes it ``n/a`` (goodput's is raised)."""
    where = f"[{rep + 1}/{repeats}] {m.name}"
    say(f"{where}: stall")
    if _give_up_on_failure(m, res, scratch, rep, where, say, lambda: _stall(m, res, state, scratch, rep, quiet=quiet)):
        return
    say(f"{where}: stall {res.stall_s[-1]:.3f} s (async save done after {res.async_total_s[-1]:.3f} s)")


def _give_up_on_failure(
    m: BenchMethod,
    res: MethodResult,
    scratch: Scratch,
    rep: int,
    where: str,
    say: Callable[[str], None],
    step: Callable[[], None],
) -> bool:
    """Run ``step``; True when torch's method failed and is now ``n/a`` (goodput's failure is raised)."""
    try:
        step()
    except BaseException as e:
        if m.name == "goodput" or not is_save_or_load_failure(e):
            raise
        res.reason = f"n/a: {m.describe_writer} failed here: {type(e).__name__}: {str(e)[:300]}"
        for s in (*SAMPLES, "save_cpu_s", "save_other_cpus"):
            getattr(res, s).clear()
        for suffix in ("-async", "-warm", ""):
            scratch.remove(f"{m.name}-{rep}{suffix}")
        say(f"{where}: {res.reason}")
        return True
    return False


def _save_load(
    m: BenchMethod,
    res: MethodResult,
    state,
    dest,
    scratch: Scratch,
    rep: int,
    *,
    check: bool,
    keep: bool,
    quiet: float,
    colds: list,
) -> None:
    """One repeat of one method: save, load, verify, by the shared procedure; appends the samples."""
    import torch.distributed.checkpoint as dcp

    from ._bench_state import flat_equal, flatten

    name = f"{m.name}-{rep}"
    names = {scratch.uri(n): n for n in (name, name + "-warm")}
    location = scratch.uri(name)

    def save(where: str) -> None:
        writer = m.writer(where)
        dcp.save(state.nested, storage_writer=writer, no_dist=True)
        wait_durable(writer)

    def stored(_where: str) -> None:
        res.files, res.stored_bytes = scratch.stored(name)

    def load(where: str) -> None:
        dcp.load(dest, storage_reader=m.reader(where), no_dist=True)

    def after_load(_: None) -> None:
        flat = flatten(dest)
        if check and not flat_equal(state.flat, flat):
            raise CheckpointError(f"bench: the state loaded from {location} differs from the one saved", path=location)
        for t in flat.values():
            t.zero_()  # the next load must write every byte (a load that skips bytes cannot pass the check)

    def after_verify(report) -> None:
        if not report.ok:
            problems = "; ".join(p.message for p in report.problems[:3])
            raise CorruptCheckpointError(f"bench: verify of {location} failed: {problems}", path=location)
        res.verify_bytes = report.bytes_hashed

    loads = [Load("load", load, after_load)] + ([Load("verify", m.verify, after_verify)] if m.verify else [])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", category=FutureWarning)
        got = save_and_load(
            save,
            loads,
            target=location,
            warm=scratch.uri(name + "-warm"),
            remove=lambda u: scratch.remove(names[u]),
            evict=lambda u: scratch.evict(names[u]),
            quiet=quiet,
            dev=_device(scratch),
            keep=keep,
            between=stored,
        )
    res.save_s.append(got.save.wall)
    res.save_cpu_s.append(got.save.cpu)
    res.save_other_cpus.append(got.save.other)
    res.load_s.append(got.loads["load"].wall)
    if "verify" in got.loads:
        res.verify_s.append(got.loads["verify"].wall)
    colds.extend(got.cold)


def _stall(m: BenchMethod, res: MethodResult, state, scratch: Scratch, rep: int, *, quiet: float) -> None:
    """How long ``dcp.async_save`` blocks the caller (it stages into fresh memory); then waited for and deleted."""
    import torch.distributed.checkpoint as dcp

    name = f"{m.name}-{rep}-async"
    wait_quiet(quiet, _device(scratch))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", category=FutureWarning)
        writer = m.writer(scratch.uri(name))
        t0 = time.perf_counter()
        fut = dcp.async_save(state.nested, storage_writer=writer, no_dist=True)
        res.stall_s.append(time.perf_counter() - t0)
        fut.result()
        wait_durable(writer)
        res.async_total_s.append(time.perf_counter() - t0)
    del fut, writer  # the staged copy goes before the next measurement
    scratch.remove(name)
    os.sync()


def _device(scratch: Scratch) -> int | None:
    """The ``st_dev`` of a local scratch root (whose disk :func:`wait_quiet` watches), else ``None``."""
    return os.stat(scratch.path).st_dev if scratch.path is not None else None


def _summary_line(r: MethodResult) -> str:
    def last_gbps(nbytes: int, xs: list[float]) -> str:
        return f"{nbytes / xs[-1] / GB:.2f} GB/s" if xs and xs[-1] > 0 else "-"

    line = f"save {last_gbps(r.payload_bytes, r.save_s)}, load {last_gbps(r.payload_bytes, r.load_s)}"
    return line + (f", verify {last_gbps(r.verify_bytes, r.verify_s)}" if r.verify_s else "")
