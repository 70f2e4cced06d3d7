"""Local staging in front of a mounted volume: save at local-disk speed, upload in the background.

``CheckpointWriter(path_on_volume, stage_dir="/local/nvme/stage")`` writes every data file to
``stage_dir`` (under the volume path, so locations never collide) and returns from ``dcp.save``
as soon as the local files are written. A small pool of upload threads then (from the moment the
rank's last staged file is closed, so that they do not slow the local write) copies each file to
the volume, once, in order, in large writes, to its final name, and the commit record (the
manifest) is written to the volume last, once every rank's files are there.
``CheckpointWriter.durable_future()`` returns a ``concurrent.futures.Future`` that completes
when that has happened (on the coordinator) or when this rank's files are on the volume (on the
other ranks), and fails with the upload's error otherwise.

Call order on one rank (the store's view of one save)::

    prepare()                              # starts a new save: its jobs are tracked apart
    open_sink(name) ... close()            # local file; the last close queues the uploads
    # coordinator only, after every rank's write_data:
    prepare_commit(all_files)              # every rank's data files, from the DCP layer
    put_commit_record(MANIFEST, data, ...) # queues the commit; returns at once
    after_commit(cleanup)                  # queued after the commit (failed saves' files)
    durable_future()                       # the DCP writer keeps it for the caller

How the coordinator knows other ranks' uploads are done: after uploading a file, a rank writes
a marker next to it on the volume; the coordinator's commit job waits for its own uploads'
futures, then for the markers of the other files (up to ``commit_timeout_s``), then writes the
manifest and deletes the markers (:mod:`._upload_markers`). A crash at any instant leaves the
volume copy committed or visibly incomplete.

Why these choices:
- The staged files are not fsynced: the durable copy is the volume's. A crash before the upload
  loses the staged copy, and the volume location then has no manifest (incomplete).
- Each uploaded file is deleted from the stage at once; the coordinator removes the emptied
  directories after its commit (other hosts keep empty directories).
- The upload pool exists only while jobs are queued or running, so a store per checkpoint (the
  manager's pattern) leaves no idle threads behind. Its threads are joined at interpreter exit
  (``concurrent.futures`` does that), so a script that saves and exits still uploads.
- Not picklable: its jobs live in this process. ``dcp.async_save``'s process executor (which
  pickles the writer) is refused; the thread executor, the default, works.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ..errors import CheckpointError
from ._upload_markers import MARKER_SUFFIX, delete_markers, wait_for_markers, write_marker
from .base import SMALL_FILE_LIMIT
from .local import LocalConfig, LocalStore
from .volume import VolumeStore

__all__ = ["DEFAULT_COMMIT_TIMEOUT_S", "DEFAULT_UPLOAD_THREADS", "StagedStore", "all_of"]

#: Files uploaded at once: several sequential streams keep a FUSE object-store mount busy
#: (each file is one upload), few enough to leave the cores to training.
DEFAULT_UPLOAD_THREADS = 4
#: How long the coordinator's commit waits for other ranks' uploads before it gives up.
DEFAULT_COMMIT_TIMEOUT_S = 3600.0
#: Bytes per read and write call of an upload: the writer's default chunk, a large write.
UPLOAD_BLOCK = 8 << 20

_log = logging.getLogger(__name__)


def all_of(futures: Iterable[Future]) -> Future:
    """A future that completes when every one of ``futures`` has, failing with the first error."""
    futures = list(futures)
    out: Future = Future()
    if not futures:
        out.set_result(None)
        return out
    left = [len(futures)]
    lock = threading.Lock()  # callbacks run on several upload threads

    def done(f: Future) -> None:
        with lock:
            if out.done():
                return
            exc = f.exception() if not f.cancelled() else CheckpointError("an upload was cancelled")
            if exc is not None:
                out.set_exception(exc)
                return
            left[0] -= 1
            if left[0] == 0:
                out.set_result(None)

    for f in futures:
        f.add_done_callback(done)
    return out


class _StagedSink:
    """A local staging file; its upload is queued once every file of the save is closed."""

    def __init__(self, store: StagedStore, name: str, local: Any) -> None:
        self._store, self._name, self._local = store, name, local
        self._closed = False

    def write_at(self, offset: int, buffers: Sequence[Any]) -> None:
        self._local.write_at(offset, buffers)

    def close(self) -> None:
        if self._closed:
            return
        self._local.close()
        self._closed = True
        self._store._sink_closed(self._name)

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self._local.abort()
            self._store._sink_aborted()
        else:  # the save failed after this file was closed: its upload must not stay
            self._store._cancel_upload(self._name)


class StagedStore:
    """A :class:`VolumeStore` whose writes are staged on local disk and uploaded in the background.

    Reads, listings and deletions go straight to the volume.

    Args:
        inner: the volume location.
        stage_dir: the local staging root; this location stages under
            ``stage_dir/<the volume path>``.
        upload_threads: files uploaded at once.
        commit_timeout_s: see :data:`DEFAULT_COMMIT_TIMEOUT_S`.
    """

    def __init__(
        self,
        inner: VolumeStore,
        stage_dir: str,
        *,
        upload_threads: int = DEFAULT_UPLOAD_THREADS,
        commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S,
    ) -> None:
        self.inner = inner
        self.uri = inner.uri
        # Each staged file is written in order (several files per rank); reads and the commit
        # record readers meet are the volume's.
        self.traits = inner.traits
        self.stage_dir = stage_dir
        self.stage_root = os.path.join(stage_dir, inner.root.lstrip(os.sep))
        self.upload_threads = upload_threads
        self.commit_timeout_s = commit_timeout_s
        self._local = LocalStore(self.stage_root, LocalConfig(fsync=False))
        # Guards the pool and this save's bookkeeping: sinks close on writer threads, jobs end
        # on upload threads, and the caller asks for the durable future.
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._running = 0
        self._jobs: list[Future] = []  # this save's uploads and commit
        self._uploads: dict[str, Future] = {}  # this save's uploads by file name
        self._commit_files: list[str] | None = None
        self._commit_job: Future | None = None
        self._open = 0  # this save's sinks not yet closed or aborted
        self._held: list[str] = []  # closed files whose upload waits for the last close

    def __repr__(self) -> str:
        return f"StagedStore({self.inner.root!r}, stage_dir={self.stage_dir!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            f"the writer for {self.uri} stages saves in {self.stage_dir} and uploads them from "
            "threads of this process, so it cannot be pickled: use dcp.async_save's thread "
            "executor (the default), not the process executor"
        )

    # -- background jobs -------------------------------------------------------------------------
    def _submit(self, fn: Any, *args: Any, track: bool = True) -> Future:
        """Run ``fn`` on the upload pool; ``track``: part of the save's durable future."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.upload_threads, thread_name_prefix="goodput-upload")
            self._running += 1
            fut = self._pool.submit(fn, *args)
            if track:
                self._jobs.append(fut)
        fut.add_done_callback(self._job_done)  # outside the lock: it may run at once
        return fut

    def _job_done(self, _fut: Future) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0 and self._pool is not None:
                self._pool.shutdown(wait=False)  # its threads exit; the next job starts a pool
                self._pool = None

    def _sink_closed(self, name: str) -> None:
        """Queue the uploads once the save's last open file is closed: until then the upload
        threads would take cores from the local writes that the caller is waiting for."""
        with self._lock:
            self._open -= 1
            self._held.append(name)
            if self._open > 0:
                return
            names, self._held = self._held, []
        for n in names:
            fut = self._submit(self._upload, n)
            with self._lock:
                self._uploads[n] = fut

    def _sink_aborted(self) -> None:
        with self._lock:
            self._open -= 1

    def _cancel_upload(self, name: str) -> None:
        """Withdraw an upload (held or queued), or delete what it uploads once it is done."""
        with self._lock:
            held = name in self._held
            if held:
                self._held.remove(name)
            fut = self._uploads.pop(name, None)
        if held:
            try:
                os.unlink(os.path.join(self.stage_root, name))
            except OSError:
                pass
            return
        if fut is None:
            return
        if fut.cancel():
            try:
                os.unlink(os.path.join(self.stage_root, name))
            except OSError:
                pass
            return

        def remove(_f: Future) -> None:
            try:
                self.delete(name)  # the file and its marker
            except CheckpointError:
                pass  # a later save at this location removes it

        fut.add_done_callback(remove)

    def _upload(self, name: str) -> None:
        """Copy one staged file to the volume, in order, in large writes; then its marker."""
        src = os.path.join(self.stage_root, name)
        try:
            sink = self.inner.open_sink(name)
            try:
                buf = bytearray(UPLOAD_BLOCK)
                view = memoryview(buf)
                pos = 0
                with open(src, "rb", buffering=0) as f:
                    while n := f.readinto(buf):
                        sink.write_at(pos, [view[:n]])
                        pos += n
                sink.close()
            except BaseException:
                sink.abort()
                raise
            write_marker(self.inner, name, pos)
        except OSError as e:
            raise CheckpointError(f"uploading the staged file {src} to {self.uri}/{name} failed: {e}", path=src) from e
        finally:
            try:
                os.unlink(src)
            except OSError:
                pass

    def _commit(self, name: str, data: bytes, replace: bool, files: list[str], own: dict[str, Future]) -> None:
        """Wait until every file is on the volume, then write the commit record there."""
        deadline = time.monotonic() + self.commit_timeout_s
        for fname, fut in own.items():
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout as e:
                raise CheckpointError(
                    f"{self.uri}: the upload of {fname} did not finish within {self.commit_timeout_s:.0f}s; "
                    "the checkpoint was not committed on the volume",
                    path=self.uri,
                ) from e
        wait_for_markers(
            self.inner, [f for f in files if f not in own], deadline=deadline, timeout_s=self.commit_timeout_s
        )
        self.inner.put_commit_record(name, data, replace=replace)
        try:  # committed: what is left is clean-up, which must not turn the save into a failure
            delete_markers(self.inner, files)
        except (OSError, CheckpointError) as e:
            _log.warning(
                "%s: the checkpoint is committed, but deleting its upload markers failed (%s); "
                "they can be deleted by hand",
                self.uri,
                e,
            )
        self._prune_stage()

    def _prune_stage(self) -> None:
        """Remove the emptied staging directories of this location (best effort)."""
        path = self.stage_root
        while path.startswith(self.stage_dir + os.sep):
            try:
                os.rmdir(path)
            except OSError:
                return
            path = os.path.dirname(path)

    def durable_future(self) -> Future:
        """A future for every upload and commit of the current save queued so far.

        It completes once they are all done, and fails with the first error. Call it after the
        save's last ``close()`` (and, on the coordinator, after ``put_commit_record``).
        """
        with self._lock:
            jobs = list(self._jobs)
        return all_of(jobs)

    # -- Store -------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Create both locations and start tracking a new save.

        A previous save through this store that is still uploading is waited for first (up to
        ``commit_timeout_s``; its outcome is its own future's): two saves to one location must
        not interleave their commits, and the stage must not grow without bound.
        """
        with self._lock:
            previous = list(self._jobs)
        wait(previous, timeout=self.commit_timeout_s)
        self.inner.prepare()
        self._local.prepare()
        with self._lock:
            self._jobs, self._uploads, self._commit_files = [], {}, None
            self._open, self._held = 0, []

    def open_sink(self, name: str, *, part_size: int | None = None) -> _StagedSink:
        self._local.prepare()  # a coordinator on this host may have pruned an empty stage dir
        local = self._local.open_sink(name)
        with self._lock:
            self._open += 1
        return _StagedSink(self, name, local)

    def prepare_commit(self, files: Sequence[str]) -> None:
        """Learn every rank's data files that the next commit record commits (see module doc)."""
        self._commit_files = list(files)

    def put_commit_record(self, name: str, data: bytes, *, replace: bool) -> None:
        """Queue the commit: the record is written on the volume once every file is there.

        Returns at once, with no request to the volume (a mount busy with uploads answers
        slowly). Without ``replace`` the background write uses ``O_EXCL``: a record that another
        writer committed meanwhile fails the durable future with ``CheckpointExistsError``. (A
        committed checkpoint that was there before the save was refused before any data was
        written, by the DCP layer.)
        """
        with self._lock:
            files = self._commit_files if self._commit_files is not None else list(self._uploads)
            own = {f: fut for f, fut in self._uploads.items() if f in set(files)}
            self._commit_files = None
        self._commit_job = self._submit(self._commit, name, bytes(data), replace, files, own)

    def after_commit(self, fn: Any) -> None:
        """Run ``fn`` in the background once the queued commit succeeded (not part of the
        durable future: the clean-up of failed saves' files must not delay it)."""
        commit = self._commit_job

        def job() -> None:
            if commit is not None and commit.exception() is not None:
                return  # not committed: nothing may be cleaned up
            fn()

        self._submit(job, track=False)

    def open_source(self, name: str) -> Any:
        return self.inner.open_source(name)

    def size(self, name: str) -> int | None:
        return self.inner.size(name)

    def read_small(self, name: str, *, max_bytes: int = SMALL_FILE_LIMIT) -> bytes | None:
        return self.inner.read_small(name, max_bytes=max_bytes)

    def list(self) -> list[str]:
        return self.inner.list()

    def delete(self, name: str) -> None:
        self.inner.delete(name)
        if not name.endswith(MARKER_SUFFIX):
            self.inner.delete(name + MARKER_SUFFIX)  # a failed save's marker goes with its file
