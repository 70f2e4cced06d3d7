"""``bench``: the checkpoint throughput your own storage gives, beside torch's own writers.

On a synthetic model-plus-optimizer state of a chosen size (:mod:`._bench_state`), each repeat
measures, for two methods side by side:

- ``goodput``: :class:`~goodput_ckpt.CheckpointWriter` / :class:`~goodput_ckpt.CheckpointReader`
  (``verify=True``: a load checks every byte it reads);
- ``torch``: torch's ``FileSystemWriter`` / ``FileSystemReader`` for paths, or its
  ``FsspecWriter`` / ``FsspecReader`` for URLs (which need the fsspec driver, e.g. ``s3fs``;
  without it the method is reported as ``n/a`` with the reason).

by one procedure, :mod:`._bench_measure`, the one ``benchmarks/bench_local.py`` runs too, so
that the same methods give the same ratios in both. Each repeat runs the methods in rotating
order (with two, they alternate which goes first); before each timed step it waits up to
``quiet`` seconds for a quiet machine. For each method:

1. **save**: a synchronous ``dcp.save``, until the checkpoint is durable, timed right after an
   untimed warm-up save of the same state that is deleted first (:mod:`._bench_save`);
2. **load**: ``dcp.load`` of that checkpoint into a preallocated state (as when resuming into a
   live model), after evicting its files from the page cache (local and volume paths;
   ``posix_fadvise``, no root needed) so the bytes come from storage;
3. **verify** (``goodput`` only; torch's format has no checksums): :func:`verify_checkpoint` of
   the same checkpoint, page cache evicted again.

Then, in a pass of its own after every save and load (so that no async save's staging copy
precedes a timed save, which the script has no counterpart of), for each repeat and method:

4. **stall**: how long ``dcp.async_save`` blocks the caller (both writers stage the state into
   fresh CPU memory, then write in a background thread); the save is then waited for, outside
   the measurement, and deleted.

The first repeat also checks that every loaded tensor equals the saved one. GB/s is the state's
payload (the sum of tensor sizes, the same for both methods; GB = 1e9 bytes) over wall seconds,
except verify, which is the bytes hashed (the checkpoint's files) over wall seconds. Each figure
is the median of the repeats; every sample is kept in the report, and the ratios goodput/torch
are also given per repeat (min / median / max, :func:`._bench_measure.ratio_spread`).

The steps of one repeat live in :mod:`._bench_steps`. Everything is written under one fresh ``goodput-bench-*`` directory or prefix
(:mod:`._bench_scratch`), removed at the end unless ``keep=True`` (then the last repeat's
checkpoint of each method stays).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from typing import Any

from .._common import NO_PROGRESS, Progress, require_positive
from ._bench_measure import DEFAULT_QUIET, run_rotation
from ._bench_methods import goodput_method, torch_method
from ._bench_report import BENCH_SCHEMA, GB, SAMPLES, BenchReport, MethodResult
from ._bench_scratch import Scratch
from ._bench_steps import save_load_or_give_up, stall_or_give_up

__all__ = [
    "BENCH_SCHEMA",
    "DEFAULT_REPEATS",
    "DEFAULT_SIZE",
    "MIN_SIZE",
    "SAMPLES",
    "BenchReport",
    "MethodResult",
    "bench",
]

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
    quiet: float = DEFAULT_QUIET,
    progress: Callable[[str], None] | None = None,
    bar: Progress = NO_PROGRESS,
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
        quiet: before each timed step, wait at most this many seconds for other processes to
            leave the CPUs and the disk idle (0: do not wait); the default is
            ``benchmarks/bench_local.py``'s too.
        progress: called with one line of text as each step starts and ends.
        bar: receives the bytes each step moved once it is done (one phase, ``bench``): a
            save-and-load step moves the state 3 times (warm-up save, timed save, load) and once
            more when the method verifies; a stall step once.
        **options: backend options for goodput's stores (``-o KEY=VALUE``). For S3 the
            endpoint, region and addressing style are also given to torch's ``FsspecWriter``.

    Returns:
        A :class:`BenchReport`.

    Raises:
        ValueError, TypeError: bad arguments or options, or not enough disk or memory for ``size``.
        CheckpointError: goodput's save, load or verify failed, or loaded different values.
    """
    for name, value in (
        ("size", size),
        ("repeats", repeats),
        ("thread_count", thread_count),
        ("torch_thread_count", torch_thread_count),
    ):
        require_positive(name, value)
    if not quiet >= 0:
        raise ValueError(f"quiet must be 0 or more seconds, got {quiet}")
    if size < MIN_SIZE:
        raise ValueError(f"size must be at least {MIN_SIZE >> 20} MiB, got {size} bytes")
    _check_memory(size)
    say = progress or (lambda _line: None)
    t_start = time.perf_counter()
    scratch = Scratch(uri, options)
    try:
        scratch.check_room(size, 3 if keep else 1)  # one at a time; with keep, two kept and the stall's
        from ._bench_state import empty_like_nested, make_state

        t0 = time.perf_counter()
        state = make_state(size, seed)
        dest = empty_like_nested(state.nested)
        say(
            f"state: {state.nbytes / 2**20:.1f} MiB in {len(state.flat)} tensors, built in "
            f"{time.perf_counter() - t0:.1f} s; writing under {scratch.root} ({scratch.backend})"
        )
        methods = [
            goodput_method(thread_count, options),
            torch_method(None if scratch.path else scratch.root, options, torch_thread_count),
        ]
        results = [
            MethodResult(
                m.name,
                m.describe_writer,
                m.describe_reader,
                state.nbytes,
                reason=m.reason,
                verify_reason=None if m.verify else "n/a: no checksums",
            )
            for m in methods
        ]
        by_name = {m.name: (m, r) for m, r in zip(methods, results)}
        last = repeats - 1
        colds: list[bool | None] = []
        load0 = os.getloadavg()

        def save_load(name: str, rep: int) -> None:
            m, res = by_name[name]
            if res.available:
                save_load_or_give_up(
                    m,
                    res,
                    state,
                    dest,
                    scratch,
                    rep,
                    repeats,
                    keep=keep and rep == last,
                    quiet=quiet,
                    colds=colds,
                    say=say,
                )
            bar.advance(_SAVE_LOAD_PASSES[m.verify is not None] * state.nbytes)

        def stall(name: str, rep: int) -> None:
            m, res = by_name[name]
            if res.available:
                stall_or_give_up(m, res, state, scratch, rep, repeats, quiet=quiet, say=say)
            bar.advance(state.nbytes)

        names = [m.name for m in methods]
        bar.start(repeats * sum(_SAVE_LOAD_PASSES[m.verify is not None] + 1 for m in methods) * state.nbytes, "bench")
        order = run_rotation(names, repeats, save_load)  # the procedure bench_local.py runs too
        run_rotation(names, repeats, stall)  # after every timed save, so that no staging copy precedes one
        report = BenchReport(
            uri=os.getcwd() if uri is None else os.fspath(uri),
            root=scratch.root,
            backend=scratch.backend,
            size_bytes=state.nbytes,
            requested_bytes=size,
            tensors=len(state.flat),
            repeats=repeats,
            seed=seed,
            thread_count=thread_count,
            torch_thread_count=torch_thread_count,
            cold_cache=None if not colds or None in colds else all(colds),
            host=_host(),
            methods=results,
            kept=[scratch.uri(f"{r.name}-{repeats - 1}") for r in results if keep and r.available],
            quiet=quiet,
            order=order,
            loadavg=[list(load0), list(os.getloadavg())],
        )
    finally:
        bar.close()
        if not keep:
            say(f"removing {scratch.root}")
            scratch.cleanup()
    report.seconds = time.perf_counter() - t_start
    return report


#: Times a save-and-load step moves the state, by whether the method verifies (warm-up save,
#: timed save, load, and the verify's read): what the bar counts.
_SAVE_LOAD_PASSES = {False: 3, True: 4}


def _check_memory(size: int) -> None:
    """Refuse a size whose state, load destination and staging copy exceed the available memory."""
    available = _meminfo("MemAvailable")
    if available is not None and 3 * size > available:
        raise ValueError(
            f"a {size / GB:.2f} GB bench needs about {3 * size / GB:.2f} GB of memory (state, load "
            f"destination, async staging copy); {available / GB:.2f} GB is available: choose a smaller size"
        )


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

    from ..._version import __version__

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
