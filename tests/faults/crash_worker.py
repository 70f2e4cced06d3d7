"""The saving process of the crash trials (test_crash_trials.py), run in a forked child.

:func:`run` is a small training loop: a :class:`CheckpointManager` (async saves, ``keep_last``)
restores the newest complete step under a root, then saves ``saves`` more steps of a model whose
values are a function of the step (:func:`expected`), so a checker can tell exactly which
step's state a checkpoint holds.

Every point where a crash matters is instrumented from the outside (wrappers installed in this
process only; the library is not changed) and appends one line ``EVENT STEP`` to a marker file
as it passes, with one unbuffered ``write`` (a line is either in the file whole or not at all
after a SIGKILL). The events, in the order a save passes them:

==================  ============================================================================
``save.begin``      the loop calls ``mgr.save`` (it first waits for the previous save)
``stage.copy``      one tensor copied into the staging buffers (caller's thread)
``save.returned``   ``mgr.save`` returned: the write runs in the background
``write.begin``     the save thread starts ``dcp.save``
``write.chunk``     one chunk written to a data file (``write_at`` returned)
``write.closing``   a data file is about to be closed, ``NAME SIZE`` appended (on S3 the close
                    completes the multipart upload: the object exists only from there on)
``write.close``     a data file closed
``commit.begin``    the manifest is about to be published
``commit.record``   local disk and volumes: the manifest's file (local: its temporary file) was
                    just created, before its bytes are written
``commit.done``     the manifest is published: the step is committed
``cleanup.delete``  a stale file removed after the commit
``retention.begin`` retention starts (after the commit, on the retention thread)
``retention.delete``  one file of an old step deleted
``write.end``       the save thread is done with the step (retention handed over)
``restore.begin`` / ``restore.delete`` / ``restore.done``  the restore at start-up
``done``            the loop finished and the manager closed
==================  ============================================================================

A *crash point* (``crash={"event": E, "n": N}``) makes this process SIGKILL itself right after
the N-th ``E`` event, from whichever thread passes it: a kill at an exact instant, to cover
phases too short for a timer to hit. Without one, the parent kills the process at a random
moment.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import torch
from torch import nn

from goodput_ckpt.format.manifest import MANIFEST_NAME

__all__ = ["TrialModel", "expected", "run", "sizes"]

_SMALL = 24


def sizes(kib: int) -> list[int]:
    """float32 element counts of the model's parameters: a few large ones (about ``kib`` KiB in
    all) and ``_SMALL`` small ones of odd sizes."""
    big = [8, 4, 2, 1, 1]
    unit = max(256, (kib << 10) // 4 // sum(big))
    return [b * unit + 3 * i for i, b in enumerate(big)] + [17 + 29 * i for i in range(_SMALL)]


_BASES: dict[tuple[int, int], torch.Tensor] = {}


def _base(i: int, n: int) -> torch.Tensor:
    t = _BASES.get((i, n))
    if t is None:
        t = _BASES[(i, n)] = torch.arange(n, dtype=torch.int64).remainder_(65_521).add_(1000 * i).to(torch.float32)
    return t


def expected(i: int, n: int, step: int) -> torch.Tensor:
    """The values of parameter ``i`` (``n`` elements) at ``step``: exact in float32."""
    return _base(i, n) + step


class TrialModel(nn.Module):
    """Parameters whose values are a function of the step; with ``frozen``, also a frozen one
    (about ``kib`` KiB, the same at every step) that ``fill`` sets only while it does not hold
    its values yet, so incremental saves reference it (its version counter stays put)."""

    def __init__(self, kib: int, frozen: bool = False) -> None:
        super().__init__()
        self.shapes = sizes(kib)
        for i, n in enumerate(self.shapes):
            self.register_parameter(f"p{i}", nn.Parameter(torch.zeros(n), requires_grad=False))
        self.frozen_n = (kib << 10) // 4 if frozen else 0
        if frozen:
            self.frozen = nn.Parameter(torch.zeros(self.frozen_n), requires_grad=False)

    def fill(self, step: int) -> None:
        with torch.no_grad():
            for i, n in enumerate(self.shapes):
                getattr(self, f"p{i}").copy_(_base(i, n)).add_(step)
            if self.frozen_n and not torch.equal(self.frozen, _base(99, self.frozen_n)):
                self.frozen.copy_(_base(99, self.frozen_n))

    def holds(self, step: int) -> bool:
        if self.frozen_n and not torch.equal(self.frozen, _base(99, self.frozen_n)):
            return False
        return all(torch.equal(getattr(self, f"p{i}"), expected(i, n, step)) for i, n in enumerate(self.shapes))


# -- instrumentation --------------------------------------------------------------------------------
class _Events:
    """Appends events to the marker file; SIGKILLs this process at the crash point."""

    def __init__(self, path: str, crash: dict[str, Any] | None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._crash = crash
        self._t0 = time.monotonic()
        self._lock = threading.Lock()  # guards the counts (events come from several threads)
        self._counts: dict[str, int] = {}
        self.stage_step: int | None = None  # the step being staged (caller's thread)
        self.write_step: int | None = None  # the step the save thread writes
        # Who deletes, per thread ("write" | "cleanup" | "retention" | "restore"): retention runs
        # on a thread of its own, beside the save thread.
        self._local = threading.local()

    @property
    def context(self) -> str:
        return getattr(self._local, "context", "write")

    @context.setter
    def context(self, value: str) -> None:
        self._local.context = value

    def __call__(self, event: str, step: int | None, extra: str = "") -> None:
        stamp = time.monotonic() - self._t0
        line = f"{event} {'-' if step is None else step} {stamp:.4f}{' ' + extra if extra else ''}\n"
        with self._lock:
            n = self._counts[event] = self._counts.get(event, 0) + 1
            os.write(self._fd, line.encode())
            if self._crash is not None and self._crash["event"] == event and self._crash["n"] == n:
                # Under the lock: no other thread's event can follow this one into the file.
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)  # never reached: SIGKILL cannot be caught


class _SinkProxy:
    """A store's sink that reports its writes and its close."""

    def __init__(self, sink: Any, name: str, events: _Events) -> None:
        self._sink, self._name, self._events = sink, name, events
        self._end = 0
        self._closed = False
        self._lock = threading.Lock()

    def write_at(self, offset: int, buffers: Any) -> None:
        self._sink.write_at(offset, buffers)
        self._written(offset, buffers)

    def _written(self, offset: int, buffers: Any) -> None:
        with self._lock:
            self._end = max(self._end, offset + sum(memoryview(b).nbytes for b in buffers))
        self._events("write.chunk", self._events.write_step)

    def close(self) -> None:
        if self._closed:  # the writer closes each sink twice (the second is a no-op)
            return self._sink.close()
        self._events("write.closing", self._events.write_step, f"{self._name} {self._end}")
        self._sink.close()
        self._closed = True
        self._events("write.close", self._events.write_step)

    def abort(self) -> None:
        self._sink.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)


class _OsProxy:
    """The ``os`` module as the local and volume stores see it: reports the creation of a
    commit record (an exclusive create of ``manifest.json`` or its temporary file)."""

    def __init__(self, events: _Events) -> None:
        self._events = events

    def open(self, path, flags, *a, **kw):  # noqa: A003 - stands in for os.open
        fd = os.open(path, flags, *a, **kw)
        if flags & os.O_EXCL and "manifest.json" in os.path.basename(os.fspath(path)):
            self._events("commit.record", self._events.write_step)
        return fd

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


class _HashedSinkProxy(_SinkProxy):
    """The same, for sinks with the optional ``write_hashed`` (S3's): the writer then takes that
    path, as it does without the wrapper."""

    def write_hashed(self, offset: int, buffers: Any, hasher: Any) -> None:
        type(self._sink).write_hashed(self._sink, offset, buffers, hasher)
        self._written(offset, buffers)


def _install(events: _Events) -> None:
    import goodput_ckpt.engine.hashed_write as hashed_write
    import goodput_ckpt.manager.background_retention as background_retention
    import goodput_ckpt.manager.chain as chain
    import goodput_ckpt.manager.save_job as save_job
    import goodput_ckpt.storage.local as local
    import goodput_ckpt.storage.volume as volume
    from goodput_ckpt.manager.staging.stager import ReusableStager
    from goodput_ckpt.storage import LocalStore, S3Store, VolumeStore

    def wrap(owner: Any, name: str, make) -> None:
        setattr(owner, name, make(getattr(owner, name)))

    def copy_into(orig):
        def f(self, *a, **kw):
            out = orig(self, *a, **kw)
            events("stage.copy", events.stage_step)
            return out

        return f

    def write(orig):
        def f(self, job, *a, **kw):
            events.write_step, events.context = job.step, "write"
            events("write.begin", job.step)
            try:
                return orig(self, job, *a, **kw)
            finally:
                events("write.end", job.step)

        return f

    def retention(orig):  # on the coordinator's retention thread (manager/background_retention.py)
        def f(root, *a, committed, **kw):
            events.context = "retention"
            events("retention.begin", committed)
            try:
                return orig(root, *a, committed=committed, **kw)
            finally:
                events.context = "write"

        return f

    def restore_scan(orig):
        def f(self, *a, **kw):
            events.context = "restore"
            try:
                return orig(self, *a, **kw)
            finally:
                events.context = "write"

        return f

    def stale(orig):
        def f(*a, **kw):
            events.context = "cleanup"
            try:
                return orig(*a, **kw)
            finally:
                events.context = "write"

        return f

    def open_sink(orig):
        def f(self, name, *a, **kw):
            sink = orig(self, name, *a, **kw)
            proxy = _HashedSinkProxy if hasattr(type(sink), "write_hashed") else _SinkProxy
            return proxy(sink, name, events)

        return f

    def put_commit_record(orig):
        def f(self, *a, **kw):
            if (a[0] if a else kw.get("name")) != MANIFEST_NAME:  # the root's job file: no step's commit
                return orig(self, *a, **kw)
            events("commit.begin", events.write_step)
            orig(self, *a, **kw)
            events("commit.done", events.write_step)

        return f

    def delete(orig):
        def f(self, *a, **kw):
            orig(self, *a, **kw)
            ctx = events.context
            if ctx != "write":
                events(f"{ctx}.delete", events.write_step if ctx != "restore" else None)

        return f

    wrap(ReusableStager, "_copy_into", copy_into)
    wrap(save_job.SaveJobs, "write", write)
    wrap(background_retention, "apply_retention", retention)
    wrap(chain.PersistentChain, "latest", restore_scan)
    wrap(hashed_write, "remove_stale_files", stale)
    local.os = volume.os = _OsProxy(events)
    for cls in (LocalStore, S3Store, VolumeStore):
        for name, make in (("open_sink", open_sink), ("put_commit_record", put_commit_record), ("delete", delete)):
            if name in vars(cls):  # VolumeStore inherits some of LocalStore's: wrap each once
                wrap(cls, name, make)


# -- the loop ---------------------------------------------------------------------------------------
def run(
    root: str,
    markers: str,
    *,
    options: dict[str, Any],
    kib: int,
    saves: int,
    keep_last: int,
    chunk_size: int | None = None,
    crash: dict[str, Any] | None = None,
    incremental: bool | int = False,
) -> None:
    """Restore the newest complete step under ``root`` and save ``saves`` more (see the module
    docstring). ``options`` are the store's (endpoint and addressing for S3); ``incremental``:
    the manager's setting (the model then has a frozen part that later saves reference)."""
    from goodput_ckpt import CheckpointManager

    torch.set_num_threads(1)
    events = _Events(markers, crash)
    _install(events)
    model = TrialModel(kib, frozen=bool(incremental))
    # No timeline file: it is not under test, and on a volume each append costs a second.
    mgr = CheckpointManager(
        root,
        keep_last=keep_last,
        async_save=True,
        chunk_size=chunk_size,
        timeline=False,
        incremental=incremental,
        **options,
    )
    events("restore.begin", None)
    last = mgr.restore(model=model)
    events("restore.done", last)
    step = 0 if last is None else last + 1
    for _ in range(saves):
        model.fill(step)
        events.stage_step = step
        events("save.begin", step)
        mgr.save(step, model=model, extra={"step": step})
        events("save.returned", step)
        step += 1
    mgr.close()
    events("done", None)
