"""``bench``: the checkpoint throughput your own storage gives, beside torch's own writers.

On a synthetic model-plus-optimizer state of a chosen size (:mod:`._bench_state`), each repeat
measures, for two methods side by side:

- ``goodput``: :class:`~goodput_ckpt.CheckpointWriter` / :class:`~goodput_ckpt.CheckpointReader`
  (``verify=True``: a load checks every byte it reads);
- ``torch``: torch's ``FileSystemWriter`` / ``FileSystemReader`` for paths, or its
  ``FsspecWriter`` / ``FsspecReader`` for URLs (which need the fsspec driver, e.g. ``s3fs``;
  without it the method is reported as ``n/a`` with the reason).

and for each of them:

1. **stall**: how long ``dcp.async_save`` blocks the caller (both writers stage the state into
   fresh CPU memory, then write in a background thread); the save is then waited for, outside
   the measurement, and deleted;
2. **save**: a synchronous ``dcp.save``, until the checkpoint is durable, timed right after an
   untimed warm-up save of the same state that is deleted first (:mod:`._bench_save`: the rule
   ``benchmarks/bench_local.py`` shares, so that both time a save in the same memory condition);
3. **load**: ``dcp.load`` of that checkpoint into a preallocated state (as when resuming into a
   live model), after evicting its files from the page cache (local and volume paths;
   ``posix_fadvise``, no root needed) so the bytes come from storage;
4. **verify** (``goodput`` only; torch's format has no checksums): :func:`verify_checkpoint` of
   the same checkpoint, page cache evicted again.

The first repeat also checks that every loaded tensor equals the saved one. The methods
alternate which goes first from one repeat to the next. GB/s is the state's payload (the sum of
tensor sizes, the same for both methods; GB = 1e9 bytes) over wall seconds, except verify, which
is the bytes hashed (the checkpoint's files) over wall seconds. Each figure is the median of the
repeats; every sample is kept in the report.

Everything is written under one fresh ``goodput-bench-*`` directory or prefix
(:mod:`._bench_scratch`), removed at the end unless ``keep=True`` (then the last repeat's
checkpoint of each method stays).
"""

from __future__ import annotations

import os
import platform
import time
import warnings
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError
from ._bench_methods import BenchMethod, goodput_method, is_save_or_load_failure, torch_method, wait_durable
from ._bench_report import BENCH_SCHEMA, GB, SAMPLES, BenchReport, MethodResult
from ._bench_save import timed_save
from ._bench_scratch import Scratch
from ._common import require_positive

__all__ = ["BENCH_SCHEMA", "DEFAULT_REPEATS", "DEFAULT_SIZE", "MIN_SIZE", "BenchReport", "MethodResult", "bench"]

#: A state large enough that the bulk is large tensors, small enough to finish in a minute or so.
DEFAULT_SIZE = 1 << 30
#: The median of three survives one disturbed repeat.
DEFAULT_REPEATS = 3
#: Below this the synthetic state's ~2 MiB of small tensors dominate.
MIN_SIZE = 4 << 20


def bench(
    uri: str | os.PathLike | None = None,
    *,
    size: int = DEFAULT_SIZE,
    repeats: int = DEFAULT_REPEATS,
    thread_count: int | None = None,
    torch_thread_count: int | None = None,
    keep: bool = False,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> BenchReport:
    """Measure save, load, stall and verify on ``uri``; see the module docstring.

    Args:
        uri: a directory (default: the current one), ``file://`` URL, a path on a mounted volume,
            or ``s3://bucket/prefix`` (or another fsspec URL). A ``goodput-bench-*`` child is
            written and removed.
        size: bytes of synthetic state (at least :data:`MIN_SIZE`). Memory needed: about 3x
            (the state, the load destination and an async save's staging copy).
        repeats: measurements per figure; the report gives every sample and the median.
        thread_count: threads of goodput's writer, reader and verify (default: each one's own).
        torch_thread_count: ``thread_count`` of torch's writer (default: torch's, 1).
        keep: leave the last repeat's checkpoints in place (listed in ``kept``).
        seed: the synthetic state's seed.
        progress: called with one line of text as each step starts and ends.
        **options: backend options for goodput's stores (``-o KEY=VALUE``). For S3 the
            endpoint, region and addressing style are also given to torch's ``FsspecWriter``.

    Returns:
        A :class:`BenchReport`.

    Raises:
        ValueError, TypeError: bad arguments or options, or not enough disk or memory for ``size``.
        CheckpointError: goodput's save, load or verify failed, or loaded different values.
    """
    for name, value in (("size", size), ("repeats", repeats), ("thread_count", thread_count),
                        ("torch_thread_count", torch_thread_count)):  # fmt: skip
        require_positive(name, value)
    if size < MIN_SIZE:
        raise ValueError(f"size must be at least {MIN_SIZE >> 20} MiB, got {size} bytes")
    _check_memory(size)
    say = progress or (lambda _line: None)
    t_start = time.perf_counter()
    scratch = Scratch(uri, options)
    try:
        scratch.check_room(size, 2 if keep else 1)  # one checkpoint at a time; two kept at the end
        from ._bench_state import empty_like_nested, make_state

        t0 = time.perf_counter()
        state = make_state(size, seed)
        dest = empty_like_nested(state.nested)
        say(f"state: {state.nbytes / 2**20:.1f} MiB in {len(state.flat)} tensors, built in "
            f"{time.perf_counter() - t0:.1f} s; writing under {scratch.root} ({scratch.backend})")  # fmt: skip
        methods = [goodput_method(thread_count, options),
                   torch_method(None if scratch.path else scratch.root, options, torch_thread_count)]  # fmt: skip
        results = [
            MethodResult(m.name, m.describe_writer, m.describe_reader, state.nbytes, reason=m.reason,
                         verify_reason=None if m.verify else "n/a: no checksums")
            for m in methods
        ]  # fmt: skip
        colds: list[bool | None] = []
        for rep in range(repeats):
            for m, res in list(zip(methods, results))[:: 1 if rep % 2 == 0 else -1]:
                if res.available:
                    keep_this = keep and rep == repeats - 1
                    _measure_or_give_up(m, res, state, dest, scratch, rep, repeats, keep=keep_this, colds=colds, say=say)
        report = BenchReport(
            uri=os.getcwd() if uri is None else os.fspath(uri), root=scratch.root, backend=scratch.backend,
            size_bytes=state.nbytes, requested_bytes=size, tensors=len(state.flat), repeats=repeats, seed=seed,
            thread_count=thread_count, torch_thread_count=torch_thread_count,
            cold_cache=None if not colds or None in colds else all(colds), host=_host(), methods=results,
            kept=[scratch.uri(f"{r.name}-{repeats - 1}") for r in results if keep and r.available],
        )  # fmt: skip
    finally:
        if not keep:
            say(f"removing {scratch.root}")
            scratch.cleanup()
    report.seconds = time.perf_counter() - t_start
    return report


def _measure_or_give_up(m: BenchMethod, res: MethodResult, state, dest, scratch: Scratch, rep: int, repeats: int, *,
                        keep: bool, colds: list, say: Callable[[str], None]) -> None:  # fmt: skip
    """:func:`_measure`; a failure of torch's method makes it ``n/a`` (goodput's is raised)."""
    where = f"[{rep + 1}/{repeats}] {m.name}"
    say(f"{where}: stall, save, load" + (", verify" if m.verify else ""))
    try:
        _measure(m, res, state, dest, scratch, rep, check=rep == 0, keep=keep, colds=colds)
    except BaseException as e:
        if m.name == "goodput" or not is_save_or_load_failure(e):
            raise
        res.reason = f"n/a: {m.describe_writer} failed here: {type(e).__name__}: {str(e)[:300]}"
        for s in SAMPLES:
            getattr(res, s).clear()
        for suffix in ("-async", "-warm", ""):
            scratch.remove(f"{m.name}-{rep}{suffix}")
        say(f"{where}: {res.reason}")
        return
    say(f"{where}: {_summary_line(res)}")


def _measure(m: BenchMethod, res: MethodResult, state, dest, scratch: Scratch, rep: int, *, check: bool, keep: bool,
             colds: list) -> None:  # fmt: skip
    """One repeat of one method: stall (async save), save, load, verify; appends the samples."""
    import torch.distributed.checkpoint as dcp

    from ._bench_state import flat_equal, flatten

    name = f"{m.name}-{rep}"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", category=FutureWarning)
        writer = m.writer(scratch.uri(name + "-async"))
        t0 = time.perf_counter()
        fut = dcp.async_save(state.nested, storage_writer=writer, no_dist=True)
        res.stall_s.append(time.perf_counter() - t0)
        fut.result()
        wait_durable(writer)
        res.async_total_s.append(time.perf_counter() - t0)
        del fut, writer  # the staged copy goes before the next measurement
        scratch.remove(name + "-async")

        location = scratch.uri(name)

        def save(where: str) -> None:
            writer = m.writer(where)
            dcp.save(state.nested, storage_writer=writer, no_dist=True)
            wait_durable(writer)

        warm = name + "-warm"
        res.save_s.append(timed_save(save, location, warm=scratch.uri(warm), remove=lambda _u: scratch.remove(warm)))
        res.files, res.stored_bytes = scratch.stored(name)

        if check:
            for t in flatten(dest).values():
                t.zero_()  # so that a load that skips bytes cannot pass the check
        colds.append(scratch.evict(name))
        reader = m.reader(location)
        t0 = time.perf_counter()
        dcp.load(dest, storage_reader=reader, no_dist=True)
        res.load_s.append(time.perf_counter() - t0)
    if check and not flat_equal(state.flat, flatten(dest)):
        raise CheckpointError(f"bench: the state loaded from {location} differs from the one saved", path=location)
    if m.verify is not None:
        colds.append(scratch.evict(name))
        t0 = time.perf_counter()
        report = m.verify(location)
        res.verify_s.append(time.perf_counter() - t0)
        if not report.ok:
            problems = "; ".join(p.message for p in report.problems[:3])
            raise CorruptCheckpointError(f"bench: verify of {location} failed: {problems}", path=location)
        res.verify_bytes = report.bytes_hashed
    if not keep:
        scratch.remove(name)


def _summary_line(r: MethodResult) -> str:
    def last_gbps(nbytes: int, xs: list[float]) -> str:
        return f"{nbytes / xs[-1] / GB:.2f} GB/s" if xs and xs[-1] > 0 else "-"

    line = (f"save {last_gbps(r.payload_bytes, r.save_s)}, stall {r.stall_s[-1]:.3f} s, "
            f"load {last_gbps(r.payload_bytes, r.load_s)}")  # fmt: skip
    return line + (f", verify {last_gbps(r.verify_bytes, r.verify_s)}" if r.verify_s else "")


def _check_memory(size: int) -> None:
    """Refuse a size whose state, load destination and staging copy exceed the available memory."""
    available = _meminfo("MemAvailable")
    if available is not None and 3 * size > available:
        raise ValueError(f"a {size / GB:.2f} GB bench needs about {3 * size / GB:.2f} GB of memory (state, load "
                         f"destination, async staging copy); {available / GB:.2f} GB is available: choose a smaller size")  # fmt: skip


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _host() -> dict[str, Any]:
    import torch

    from .._version import __version__

    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "goodput_ckpt": __version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": _meminfo("MemTotal"),
    }
