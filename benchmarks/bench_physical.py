"""Our local save against the physical limit: a raw ``write`` + ``fsync`` of the same bytes (issue 38).

One process, one synthetic model-plus-optimizer state (``goodput_ckpt.tools.measure._bench_state``, fixed
seed), every method in the same run, the order rotating per repeat, each timed save after an
untimed warm-up save of the same method (``goodput_ckpt.tools.measure._bench_save.timed_save``):

- ``raw``: the tensors' bytes written in order into one file by one thread (``os.write`` of at most
  64 MiB), then the file and the directory fsynced: the disk's limit for these bytes;
- ``ours``: ``dcp.save`` with ``CheckpointWriter`` at its defaults (it fsyncs its files, the
  manifest and the directory itself; ``direct_writes=None``: it writes through the page cache or
  around it as ``goodput_ckpt/storage/write_mode.py`` decides when it opens its data file);
- ``ours-buffered``: the same through the page cache (``direct_writes=False``);
- ``ours-direct``: the same around the page cache (``direct_writes=True``);
- ``ours-tN``: the same with ``thread_count=N`` (``--threads``), to show what the writer threads buy.

Printed per method: seconds and the ratio **raw seconds / method seconds within the same repeat**
(1.0: as fast as the raw write), min / median / max over ``--repeats``; user and system CPU
seconds and minor page faults of the process during each save, and the full (generation 2) garbage
collections that ran inside the timed saves, summed over the repeats (``full_gc`` in the JSON
lists them per repeat: a save's own allocations can trigger a collection of the whole process,
which a raw write never does); and, per repeat, the load
average, the CPU and memory pressure (PSI ``some avg10``) and what ``ours`` chose from them.

``--load N,MIB`` starts an artificial load for the run and stops it (by PID) at the end: ``N``
processes in busy loops and, with ``MIB`` > 0, one process that keeps writing a file of ``MIB``
MiB through the page cache and reading it back (dirty pages and page-cache churn), so one session
shows both regimes: a quiet machine and a contended one.

``--phases`` adds, per repeat, one more save of ``ours`` (not in the ratios) with timers around its
parts: blake3 hashing, ``pwritev``, direct writes' ``pwrite`` (none at the defaults) and ``sync_file_range`` (summed over the writer threads: a sum
above the save's wall time means threads waited on each other), the file's ``fsync`` at close,
``write_hashed_files`` as a whole (wall), the commit record, and the rest of ``dcp.save`` (torch's
planning, metadata, our manifest build), plus the count of full (generation 2) garbage collections
and their seconds. The timers wrap the library's functions from this script only.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_physical.py --size 256MiB --repeats 5 --phases``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointWriter
from goodput_ckpt.cli._output import parse_size
from goodput_ckpt.tools.measure._bench_measure import rotated
from goodput_ckpt.tools.measure._bench_measure import spread_of as stats
from goodput_ckpt.tools.measure._bench_save import timed_save
from goodput_ckpt.tools.measure._bench_state import State, make_state

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", category=FutureWarning)

MiB = 1 << 20


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_save(state: State, where: str) -> None:
    """The tensors' bytes in order into one file, one thread, then fsync of the file and directory."""
    os.makedirs(where)
    fd = os.open(os.path.join(where, "raw.bin"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for t in state.flat.values():
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
            while view:
                view = view[os.write(fd, view[: 64 * MiB]) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync(where)


def ours_save(state: State, where: str, **kw: Any) -> None:
    dcp.save(state.nested, storage_writer=CheckpointWriter(where, **kw))


def _busy(deadline: float) -> None:
    x = 0
    while time.time() < deadline:
        for _ in range(100_000):
            x += 1


def _churn(path: str, mib: int, deadline: float) -> None:
    block = os.urandom(MiB)
    try:
        while time.time() < deadline:
            with open(path, "wb") as f:
                for _ in range(mib):
                    f.write(block)
            with open(path, "rb") as f:
                while f.read(8 * MiB):
                    pass
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def artificial_load(spec: str, where: str, settle_s: float, limit_s: float = 1800.0) -> Iterator[str]:
    """``N,MIB``: N busy loops and a page-cache churner of MIB MiB (see the module doc), each
    process ending by itself after ``limit_s`` and stopped by PID when the block ends."""
    import multiprocessing as mp

    n, _, mib = spec.partition(",")
    deadline = time.time() + limit_s
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_busy, args=(deadline,), daemon=True) for _ in range(int(n or 0))]
    if int(mib or 0) > 0:
        churn = os.path.join(where, "churn.bin")
        procs.append(ctx.Process(target=_churn, args=(churn, int(mib), deadline), daemon=True))
    for proc in procs:
        proc.start()
    try:
        time.sleep(settle_s if procs else 0)  # let the pressure figures (10 s averages) see the load
        yield f"{n or 0} busy loops, page-cache churn of {mib or 0} MiB, PIDs {[p.pid for p in procs]}"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join(10)


def _regime() -> str:
    from goodput_ckpt.storage.write_mode import pressure, should_write_direct

    direct, why = should_write_direct()
    cpu, mem = pressure("cpu"), pressure("memory")
    return f"psi cpu {cpu}, memory {mem}; auto -> {'direct' if direct else 'buffered'} ({why})"


def _clock(fn: Callable[[], Any]) -> dict[str, float]:
    g0 = gc.get_stats()[2]["collections"]
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall": wall,
        "user": r1.ru_utime - r0.ru_utime,
        "sys": r1.ru_stime - r0.ru_stime,
        "minflt": float(r1.ru_minflt - r0.ru_minflt),
        "full_gc": float(gc.get_stats()[2]["collections"] - g0),
    }


# -- --phases: timers around the library's parts, installed by this script only -------------------
@contextlib.contextmanager
def phase_timers() -> Iterator[dict[str, list[float]]]:
    """Wrap the save's parts with timers; yields ``{part: [seconds, calls]}``, filled by the save."""
    import blake3 as real_blake3

    import goodput_ckpt.dcp.writer as wr
    import goodput_ckpt.engine.hashed_write as hw
    import goodput_ckpt.storage.local as local
    import goodput_ckpt.storage.local_sink as sink

    acc: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    lock = threading.Lock()

    def add(part: str, seconds: float) -> None:
        with lock:
            acc[part][0] += seconds
            acc[part][1] += 1

    def timer(part: str, fn: Callable) -> Callable:
        def wrapped(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                add(part, time.perf_counter() - t)

        return wrapped

    class _Hasher:
        def __init__(self) -> None:
            self._h = real_blake3.blake3()

        def update(self, b: Any) -> None:
            t = time.perf_counter()
            self._h.update(b)
            add("blake3 (thread-s)", time.perf_counter() - t)

        def hexdigest(self) -> str:
            return self._h.hexdigest()

    gc_start: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                gc_start.append(time.perf_counter())
            elif gc_start:
                add("full gc", time.perf_counter() - gc_start.pop())

    saved = [
        (os, "pwritev", os.pwritev),
        (hw, "blake3", hw.blake3),
        (os, "pwrite", os.pwrite),
        (sink, "_SYNC_FILE_RANGE", sink._SYNC_FILE_RANGE),
        (sink.LocalSink, "close", sink.LocalSink.close),
        (local.LocalStore, "put_commit_record", local.LocalStore.put_commit_record),
        (wr, "write_hashed_files", wr.write_hashed_files),
    ]
    os.pwritev = timer("pwritev (thread-s)", os.pwritev)
    hw.blake3 = type("blake3", (), {"blake3": _Hasher})
    os.pwrite = timer("direct pwrite (thread-s)", os.pwrite)
    if sink._SYNC_FILE_RANGE is not None:
        sink._SYNC_FILE_RANGE = timer("sync_file_range (thread-s)", sink._SYNC_FILE_RANGE)
    sink.LocalSink.close = timer("file fsync at close", sink.LocalSink.close)
    local.LocalStore.put_commit_record = timer("commit record (fsyncs)", local.LocalStore.put_commit_record)
    wr.write_hashed_files = timer("write_hashed_files (wall)", wr.write_hashed_files)
    gc.callbacks.append(on_gc)
    try:
        yield acc
    finally:
        gc.callbacks.remove(on_gc)
        for obj, name, value in saved:
            setattr(obj, name, value)


def _phases_once(state: State, base: str, rep: int) -> dict[str, Any]:
    where = os.path.join(base, f"phases-{rep}")
    ours_save(state, where + "-warm")
    shutil.rmtree(where + "-warm")
    os.sync()
    with phase_timers() as acc:
        c = _clock(lambda: ours_save(state, where))
    shutil.rmtree(where)
    parts = {k: {"seconds": round(v[0], 4), "calls": v[1]} for k, v in acc.items()}
    inner = acc.get("write_hashed_files (wall)", [0.0])[0] + acc.get("commit record (fsyncs)", [0.0])[0]
    parts["rest of dcp.save (planning, metadata, manifest)"] = {"seconds": round(c["wall"] - inner, 4), "calls": 1}
    return {"wall": c["wall"], "parts": parts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", default="", help="extra ours-tN methods (thread_count), comma-separated; '' for none")
    p.add_argument("--phases", action="store_true", help="one instrumented save per repeat (see the module doc)")
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load", default="", help="N,MIB: an artificial load for the run (see the module doc)")
    p.add_argument("--settle", type=float, default=10.0, help="seconds between starting --load and the first save")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be at least 1")

    state = make_state(parse_size(a.size), a.seed)
    methods: dict[str, Callable[[str], None]] = {
        "raw": lambda w: raw_save(state, w),
        "ours": lambda w: ours_save(state, w),
        "ours-buffered": lambda w: ours_save(state, w, direct_writes=False),
        "ours-direct": lambda w: ours_save(state, w, direct_writes=True),
    }
    for n in [int(x) for x in a.threads.split(",") if x.strip()]:
        methods[f"ours-t{n}"] = lambda w, n=n: ours_save(state, w, thread_count=n)
    names = list(methods)
    base = tempfile.mkdtemp(prefix="goodput-physical-", dir=a.dir)
    load0 = os.getloadavg()
    print(
        f"state {state.nbytes / MiB:.0f} MiB in {len(state.flat)} tensors, {a.repeats} repeats, under {base}; "
        f"load average {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f}, {os.cpu_count()} CPUs"
    )
    samples: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    orders: list[list[str]] = []
    phases: list[dict[str, Any]] = []
    regimes: list[str] = []
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, base, ignore_errors=True)
        if a.load:
            print(f"artificial load: {stack.enter_context(artificial_load(a.load, base, a.settle))}")
        for rep in range(a.repeats):
            order = rotated(names, rep)
            orders.append(order)
            regimes.append(_regime())
            for n in order:
                target = os.path.join(base, f"{n}-{rep}")
                c = timed_save(methods[n], target, warm=target + "-warm", remove=shutil.rmtree, clock=_clock)
                shutil.rmtree(target)
                os.sync()
                samples[n].append(c)
            if a.phases:
                phases.append(_phases_once(state, base, rep))
            print(
                f"repeat {rep + 1}: order {', '.join(order)}; load average {os.getloadavg()[0]:.1f}; "
                f"before it: {regimes[-1]}"
            )

    load1 = os.getloadavg()
    report: dict[str, Any] = {
        "bytes": state.nbytes,
        "tensors": len(state.flat),
        "repeats": a.repeats,
        "order": orders,
        "regimes": regimes,
        "artificial_load": a.load,
        "load_average": [load0[0], load1[0]],
        "seconds": {},
        "vs_raw": {},
        "cpu": {},
        "full_gc": {},
    }
    print(
        f"\n{'method':<14}{'seconds (median)':>18}{'raw/method min':>16}{'median':>8}{'max':>7}"
        f"{'user s':>8}{'sys s':>7}{'minflt':>8}{'full gc':>9}"
    )
    for n in names:
        walls = [s["wall"] for s in samples[n]]
        ratio = [r["wall"] / s["wall"] for r, s in zip(samples["raw"], samples[n])]
        report["seconds"][n] = stats(walls)
        report["vs_raw"][n] = stats(ratio)
        cpu = {k: statistics.median(s[k] for s in samples[n]) for k in ("user", "sys", "minflt")}
        report["cpu"][n] = cpu
        gcs = [int(s["full_gc"]) for s in samples[n]]
        report["full_gc"][n] = gcs
        print(
            f"{n:<14}{statistics.median(walls):>18.3f}{min(ratio):>16.2f}{statistics.median(ratio):>8.2f}"
            f"{max(ratio):>7.2f}{cpu['user']:>8.2f}{cpu['sys']:>7.2f}{cpu['minflt']:>8.0f}{sum(gcs):>9}"
        )
    if phases:
        report["phases"] = phases
        print("\nparts of an instrumented ours save (median over repeats; thread-s: summed over writer threads)")
        print(f"  {'save (wall)':<50}{statistics.median(ph['wall'] for ph in phases):>8.3f} s")
        for part in dict.fromkeys(k for ph in phases for k in ph["parts"]):
            vals = [ph["parts"].get(part, {"seconds": 0.0, "calls": 0}) for ph in phases]
            print(
                f"  {part:<50}{statistics.median(v['seconds'] for v in vals):>8.3f} s"
                f"{statistics.median(v['calls'] for v in vals):>8.0f} calls"
            )
    print(f"load average at the end {load1[0]:.1f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
