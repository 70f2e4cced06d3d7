"""``verify``: check a checkpoint completely, without loading it and without torch.

What is checked, in order:

1. the manifest exists (else the checkpoint is *incomplete*), parses, is of a known version and
   is self-consistent (:func:`~goodput_ckpt.format.parse_manifest` checks its own digest, types,
   ranges, paths, byte ranges inside files, chunk tiling and item overlaps). A manifest that
   fails this is *corrupt* where commits are atomic (local disk, S3), but *incomplete* on a
   mounted volume, where it may be a record still being written or cut short by a killed save
   (the reader decides the same way: both read it with
   :func:`~goodput_ckpt.format.commit_record.read_commit_record`);
2. every listed file exists with exactly its recorded size;
3. unless ``quick``: every hash chunk of every file matches its blake3 digest.

A stock torch DCP checkpoint (``.metadata`` + ``.distcp`` files) is verified as far as DCP
allows (:mod:`._dcp_foreign`): every file ``.metadata`` names is present and holds the byte
ranges it claims, and the claims are consistent; DCP records no checksums, so no bytes are
hashed, and ``notes`` says so. Its ``format`` is ``torch-dcp``.

Every problem is reported, not only the first, each with the file, the byte range and the keys
whose bytes lie there. Files at the location that the manifest does not list are reported as
warnings (leftovers of a failed save; they do not make a checkpoint corrupt).

Hashing runs on a pool of threads, each reading a few chunks at a time into its own reusable
buffer with the store's ranged reads and hashing them (blake3 releases the GIL). A buffer holds
at most :data:`TASK_BYTES`, and no more than the task it reads: a chunk larger than that (the
format allows 1 GiB) is read and hashed piece by piece, so memory is at most
``thread_count * min(TASK_BYTES, largest file)`` whatever the checkpoint and chunk sizes, and
throughput follows the disk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from ...errors import CheckpointError
from ...format.commit_record import (
    COMMITTED,
    CORRUPT,
    MISSING,
    TORN,
    UNSUPPORTED,
    KeyIndex,
    bad_chunks,
    checksum_error,
    file_problems,
    read_commit_record,
)
from ...format.manifest import FORMAT_NAME, MANIFEST_NAME, FileEntry, Manifest
from ...format.references import with_references
from ...storage import FileSource, Store
from .._common import NO_PROGRESS, Progress, is_dcp_location, open_location, refuse_plain_file, require_positive

__all__ = ["DEFAULT_VERIFY_THREADS", "Problem", "TASK_BYTES", "VerifyReport", "verify_checkpoint"]

#: Parallel reads: enough requests in flight to keep an SSD's (or S3's) queue busy while other
#: threads hash. Measured with benchmarks/bench_tools.py.
DEFAULT_VERIFY_THREADS = 8
#: Bytes one task reads and hashes (rounded to whole chunks, at least one), and the most one
#: read brings in (a larger chunk is read in pieces). Large enough to amortize a syscall, small
#: enough to bound memory at threads x this.
TASK_BYTES = 16 << 20


@dataclass
class Problem:
    """One thing wrong with a checkpoint.

    Attributes:
        kind: ``incomplete``, ``manifest``, ``version``, ``missing``, ``size``, ``checksum``,
            ``unreadable`` or, for warnings, ``extra``.
        message: what is wrong and what to do, for people.
        file: the file concerned, relative to the checkpoint location.
        byte_range: ``[start, end)`` within ``file``.
        keys: the state-dict keys whose bytes are affected.
    """

    kind: str
    message: str
    file: str | None = None
    byte_range: tuple[int, int] | None = None
    keys: list[str] = field(default_factory=list)


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_checkpoint`.

    ``status`` is ``ok``, ``corrupt`` (a committed checkpoint whose bytes or manifest are
    damaged), ``incomplete`` (no manifest, or on a mounted volume one that does not validate: a
    save never committed) or ``unsupported`` (a manifest version this library does not read).
    """

    uri: str
    status: str
    quick: bool
    format: str = FORMAT_NAME
    version: int | None = None
    world_size: int | None = None
    files: int = 0
    bytes_total: int = 0
    #: Of ``bytes_total``, the bytes of files another location holds (an incremental save's
    #: references, docs/format.md "References"); they are checked like the location's own.
    bytes_referenced: int = 0
    bytes_hashed: int = 0
    chunks_checked: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    #: What could not be checked and why (a DCP checkpoint has no hashes).
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def gbps(self) -> float:
        """Hashing throughput in GB/s (1e9 bytes)."""
        return self.bytes_hashed / self.seconds / 1e9 if self.seconds > 0 else 0.0


def verify_checkpoint(
    uri: str,
    *,
    quick: bool = False,
    thread_count: int | None = None,
    progress: Progress = NO_PROGRESS,
    **options: Any,
) -> VerifyReport:
    """Check the checkpoint at ``uri``; see the module docstring for what is checked.

    Args:
        uri: the checkpoint location (local path, ``file://``, or any URI the stores accept).
        quick: check the manifest and file sizes only; skip hashing.
        thread_count: parallel reads (default :data:`DEFAULT_VERIFY_THREADS`).
        progress: receives the bytes hashed.
        **options: backend options for the store.

    Returns:
        A :class:`VerifyReport`; problems are reported in it, not raised.

    Raises:
        CheckpointNotFoundError: nothing is stored at ``uri``.
        CheckpointError: the location cannot be listed or read at all (permissions, network).
    """
    require_positive("thread_count", thread_count)
    t0 = time.perf_counter()
    store = open_location(uri, options)
    report = VerifyReport(uri=store.uri, status="ok", quick=quick)
    refuse_plain_file(store)
    if is_dcp_location(store):
        _check_dcp(store, report)
        report.seconds = time.perf_counter() - t0
        return report
    manifest = _check_manifest(store, report)
    if manifest is not None:
        keys = KeyIndex(manifest)
        store = with_references(store, manifest)  # an incremental save's files: checked where they live
        present = _check_files(store, manifest, keys, report)
        if not quick:
            _check_hashes(store, manifest, present, keys, report, thread_count or DEFAULT_VERIFY_THREADS, progress)
    report.seconds = time.perf_counter() - t0
    if report.problems and report.status == "ok":
        report.status = "corrupt"
    return report


def _check_dcp(store: Store, report: VerifyReport) -> None:
    from ._dcp_foreign import DCP_FORMAT, NO_HASHES, read_dcp

    view = read_dcp(store)
    report.format = DCP_FORMAT
    report.world_size = view.world_size
    report.files = len(view.files)
    report.bytes_total = view.file_bytes
    report.notes.append(NO_HASHES)
    for kind, file, message, keys in view.problems:
        report.problems.append(Problem(kind, message, file=file, keys=keys))
    if report.problems:
        report.status = "corrupt"


def _check_manifest(store: Store, report: VerifyReport) -> Manifest | None:
    record = read_commit_record(store)
    if record.status == MISSING:
        if not record.file_count or record.foreign:
            record.manifest_or_raise()  # nothing, or another tool's layout: CheckpointNotFoundError
        report.status = "incomplete"
        report.problems.append(Problem("incomplete", record.message))
        return None
    if record.status == TORN:  # a record still being written, or cut short (volumes)
        report.status = "incomplete"
        report.problems.append(Problem("incomplete", record.message, file=MANIFEST_NAME))
        return None
    if record.status == CORRUPT:
        report.problems.append(Problem("manifest", record.message, file=MANIFEST_NAME, keys=_split(record.error.key)))
        return None
    if record.status == UNSUPPORTED:
        report.status = "unsupported"
        version = record.error.version
        report.version = version if isinstance(version, int) and not isinstance(version, bool) else None
        report.problems.append(Problem("version", record.message, file=MANIFEST_NAME))
        return None
    assert record.status == COMMITTED
    manifest = record.manifest
    report.version = manifest.version
    report.world_size = manifest.world_size
    report.files = len(manifest.files)
    report.bytes_total = manifest.total_bytes()
    report.bytes_referenced = manifest.referenced_bytes()
    return manifest


def _check_files(store: Store, manifest: Manifest, keys: KeyIndex, report: VerifyReport) -> dict[str, int]:
    """Sizes; returns the present files with the bytes that can be hashed in each."""
    problems = {p.file: p for p in file_problems(store, manifest, keys)}
    for p in problems.values():
        report.problems.append(Problem(p.kind, p.message, file=p.file, byte_range=p.byte_range, keys=list(p.keys)))
    present: dict[str, int] = {}
    for f in manifest.files.values():
        p = problems.get(f.path)
        if p is None:
            present[f.path] = f.size
        elif p.kind == "size":  # the bytes both sizes share can still be hashed
            present[f.path] = p.byte_range[0]
    listed = set(manifest.files) | {MANIFEST_NAME}
    try:
        extra = [n for n in store.list() if n not in listed]
    except CheckpointError:
        extra = []
    for name in extra:
        report.warnings.append(
            Problem("extra", f"{name} is not listed in the manifest (a leftover of a failed save?)", file=name)
        )
    return present


@dataclass(frozen=True)
class _Task:
    file: str
    first: int  # first chunk index
    count: int  # chunks


def _check_hashes(
    store: Store,
    manifest: Manifest,
    present: dict[str, int],
    keys: KeyIndex,
    report: VerifyReport,
    thread_count: int,
    progress: Progress,
) -> None:
    cs = manifest.chunk_size
    per_task = max(1, TASK_BYTES // cs)
    tasks: list[_Task] = []
    for name, available in present.items():
        whole = _hashable_chunks(manifest.files[name], available, cs)
        for first in range(0, whole, per_task):
            tasks.append(_Task(name, first, min(per_task, whole - first)))
    total = sum(min(t.count * cs, manifest.files[t.file].size - t.first * cs) for t in tasks)
    progress.start(total, "verify")
    sources: dict[str, FileSource] = {}
    bad: dict[str, list[int]] = {}
    unreadable: list[Problem] = []
    local = threading.local()  # one reusable buffer per worker: memory is threads x buffer size
    lock = threading.Lock()  # guards bad / unreadable / report counters

    def run(task: _Task) -> None:
        entry = manifest.files[task.file]
        lo = task.first * cs
        hi = min(entry.size, (task.first + task.count) * cs)
        need = min(hi - lo, TASK_BYTES)  # bounded by the task (hence the file) and TASK_BYTES
        buf = getattr(local, "buf", None)
        if buf is None or len(buf) < need:
            buf = local.buf = bytearray(need)

        def pieces():  # the task's bytes, one buffer-full at a time (bad_chunks hashes each before the next)
            for pos in range(lo, hi, len(buf)):
                view = memoryview(buf)[: min(len(buf), hi - pos)]
                sources[task.file].read_into(pos, [view])
                yield view

        try:
            mismatched = bad_chunks(entry, cs, lo, pieces())
        except CheckpointError as e:  # shrank while we read, or an I/O error
            with lock:
                unreadable.append(
                    Problem(
                        "unreadable", str(e), file=task.file, byte_range=(lo, hi), keys=keys.keys(task.file, lo, hi)
                    )
                )
            return
        with lock:
            report.chunks_checked += task.count
            report.bytes_hashed += hi - lo
            if mismatched:
                bad.setdefault(task.file, []).extend(mismatched)
        progress.advance(hi - lo)

    try:
        for name in sorted({t.file for t in tasks}):
            try:
                sources[name] = store.open_source(name)
            except CheckpointError as e:
                report.problems.append(Problem("unreadable", str(e), file=name))
        runnable = [t for t in tasks if t.file in sources]
        _run_all(run, runnable, thread_count)
    finally:
        for src in sources.values():
            src.close()
        progress.close()
    report.problems.extend(unreadable)
    for name in sorted(bad):
        report.problems.extend(_checksum_problems(store.uri, name, sorted(bad[name]), manifest.files[name], cs, keys))


def _run_all(fn: Callable[[_Task], None], tasks: list[_Task], thread_count: int) -> None:
    """Run ``fn`` on every task; a worker's unexpected error stops the rest and is raised."""
    with ThreadPoolExecutor(thread_count, thread_name_prefix="goodput-verify") as pool:
        futures = {pool.submit(fn, t) for t in tasks}
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for fut in done:
            if fut.exception() is not None:
                for p in pending:
                    p.cancel()
                raise fut.exception()


def _hashable_chunks(entry: FileEntry, available: int, cs: int) -> int:
    """Chunks of ``entry`` whose bytes are all present (a truncated file is reported by size)."""
    if available >= entry.size:
        return len(entry.chunks)
    return available // cs


def _checksum_problems(
    uri: str, name: str, chunks: list[int], entry: FileEntry, cs: int, keys: KeyIndex
) -> list[Problem]:
    """One problem per run of consecutive bad chunks."""
    out = []
    i = 0
    while i < len(chunks):
        j = i
        while j + 1 < len(chunks) and chunks[j + 1] == chunks[j] + 1:
            j += 1
        lo, hi = chunks[i] * cs, min(entry.size, (chunks[j] + 1) * cs)
        affected = keys.keys(name, lo, hi)
        err = checksum_error(uri, name, lo, hi, chunks[i], affected, last_chunk=chunks[j])
        out.append(Problem("checksum", str(err), file=name, byte_range=(lo, hi), keys=affected))
        i = j + 1
    return out


def _split(key: str | None) -> list[str]:
    return [k.strip() for k in key.split(",")] if key else []
