"""The steps under a manager root: which are complete, which to delete, and deleting them.

No torch here: a root is a :class:`~goodput_ckpt.storage.Store` whose files are grouped into step
directories by :mod:`.layout`. A step is *complete* when its commit record (``manifest.json``)
exists, *incomplete* otherwise (a save that is running, failed or was interrupted). On a store
whose commit record is written in place (a mounted volume: ``traits.atomic_commit_record`` false), the
record must also validate: a torn record is a save that did not finish, so the scan reads it.

Retention policy (:func:`retention_victims`), applied after the commit of step ``committed``
while no other save of the same job runs:

- complete steps other than the newest ``keep_last`` (by step number) go;
- incomplete steps older than ``committed`` go (failed or interrupted saves);
- never deleted: ``committed``, the newest complete step, incomplete steps newer than
  ``committed`` (they may be in the middle of being written), and a step whose files a step
  that stays references (an incremental save's base: :func:`spare_referenced`);
- in the steps just committed, files of failed earlier saves of the same step that the new
  record does not list (:mod:`.step_leftovers`: a manager's step writer does not list its
  location before the save on S3, issue 37).

On the persistent root, retention runs on a thread of its own after the commit, beside the next
save (:mod:`.background_retention`, which says why that is safe: a save of a step a run may
delete, a rollback or an overwrite, waits for it; a run spares newer saves). With batched
deletes (:func:`delete_step`) a step costs 18 requests at 16,384 ranks, not 16,385.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Collection

from ..errors import CheckpointError
from ..format.commit_record import MISSING, TORN, read_commit_record
from ..format.manifest import MANIFEST_NAME
from ..storage.base import StaleUploads, Store
from ..storage.bulk import delete_files
from .step_layout import list_step_dirs, parse_step_dir, step_dir_name
from .step_leftovers import remove_leftovers
from .step_references import protected_steps, referrers_first
from .timeline import TIMELINE_NAME

__all__ = [
    "StepScan",
    "apply_retention",
    "clean_before_restore",
    "delete_step",
    "deletion_order",
    "describe_fresh_start",
    "note_committed",
    "retention_victims",
    "scan_steps",
    "spare_referenced",
]

logger = logging.getLogger("goodput_ckpt.retention")


class StepScan:
    """One listing of a root: step -> its files, split into complete and incomplete steps."""

    def __init__(self, files: dict[int, list[str]], torn: set[int] = frozenset()) -> None:
        self.files = files
        self.complete = [s for s, f in files.items() if MANIFEST_NAME in f and s not in torn]
        self.incomplete = [s for s, f in files.items() if MANIFEST_NAME not in f or s in torn]

    @property
    def latest(self) -> int | None:
        return self.complete[-1] if self.complete else None


def scan_steps(root: Store) -> StepScan:
    """List ``root`` once (steps ascending); on a store without atomic commit records, also read
    each step's record to tell a torn one from a commit."""
    skipped: list[str] = []
    files = list_step_dirs(root, skipped)
    if skipped:
        _warn_skipped(root, skipped)
    torn: set[int] = set()
    if not root.traits.atomic_commit_record:
        for step, names in files.items():
            if MANIFEST_NAME in names and _record_is_torn(root, step, names):
                torn.add(step)
    return StepScan(files, torn)


#: (root, name) of the unsafe names already warned about: one warning each per process, not one
#: per save (bounded by what is stored under the root).
_warned: set[tuple[str, str]] = set()


def _warn_skipped(root: Store, names: list[str]) -> None:
    """Name, once, the objects in step directories that no store call may touch (see
    :func:`~.step_layout.list_step_dirs`): they stay where they are, and retention goes on."""
    new = [n for n in names if (root.uri, n) not in _warned]
    if new:
        _warned.update((root.uri, n) for n in new)
        shown = ", ".join(repr(n) for n in new[:5]) + (f" and {len(new) - 5} more" if len(new) > 5 else "")
        logger.warning(
            "skipping %d object(s) under %s whose names are not safe relative paths (left in place, "
            "never read or deleted; remove them by hand): %s",
            len(new),
            root.uri,
            shown,
        )


def _record_is_torn(root: Store, step: int, names: list[str]) -> bool:
    # Missing: deleted since the listing. Corrupt, unsupported or unreadable: complete but
    # unusable (an unknown version, say), which restore reports.
    try:
        return read_commit_record(root, step_dir_name(step), listing=names).status in (TORN, MISSING)
    except CheckpointError:
        return False


def retention_victims(scan: StepScan, *, committed: int, keep_last: int | None) -> list[int]:
    """The steps to delete after ``committed`` was committed (see the module doc), ascending."""
    doomed = [s for s in scan.incomplete if s < committed]
    if keep_last is not None and scan.complete:
        keep = set(scan.complete[-keep_last:]) | {committed, scan.complete[-1]}
        doomed += [s for s in scan.complete if s not in keep]
    return sorted(doomed)


def spare_referenced(
    root: Store,
    scan: StepScan,
    doomed: Collection[int],
    *,
    fresh: Collection[int] = (),
    records: dict[int, bytes] | None = None,
) -> list[int]:
    """``doomed`` less every step whose files a complete step that stays still references (an
    incremental save's base, :mod:`.step_references`), ascending. ``records``: filled with the
    commit records read (:func:`~.step_references.protected_steps`)."""
    if not doomed:
        return []
    gone = set(doomed)
    kept = [s for s in scan.complete if s not in gone]
    needed = protected_steps(root, scan.files, kept, fresh=fresh, doomed=gone, records=records)
    return sorted(gone - needed)


def deletion_order(root: Store, files: dict[int, list[str]], victims: Collection[int]) -> list[int]:
    """``victims`` in the order to delete them: a step that references another victim (an
    incremental save and its base, both beyond ``keep_last``) is deleted before the step it
    references, so a crash between two deletions never leaves a complete step whose base is
    gone (found by the SIGKILL trials: oldest first, a kill after the base's deletion left the
    referencing step corrupt). Decided from the references (``files``: the root's listing by
    step), not from step numbers: a base may be a later step than its referrer (a job rolled
    back, :func:`~.step_references.referrers_first`)."""
    return referrers_first(root, files, victims)


def apply_retention(root: Store, *, committed: int, keep_last: int | None, protect: Collection[int] = ()) -> None:
    """Delete what :func:`retention_victims` names after ``committed``, except ``protect`` (steps
    still being read: a persist in flight), and what those reference, as a kept step's bases
    are. Best effort: a failure is logged, and the next commit retries."""
    noted = _take_committed(root, committed)  # this run's commit, and those of runs merged into it
    try:
        scan = scan_steps(root)
        victims = [s for s in retention_victims(scan, committed=committed, keep_last=keep_last) if s not in protect]
        records = {committed: noted[committed]} if committed in noted else None
        spared = spare_referenced(root, scan, victims, fresh=(committed,), records=records)
        for s in deletion_order(root, scan.files, spared):
            delete_step(root, s, scan.files[s])
        # Files of failed saves in the steps just committed: no step writer of a manager lists
        # its location before the save (issue 37, step_leftovers.py).
        remove_leftovers(root, scan.files, {s: r for s, r in noted.items() if s not in spared})
    except CheckpointError as e:
        logger.warning("retention under %s failed (will retry after the next save): %s", root.uri, e)


#: The commit records this process's manager saves just wrote (the step location's URI -> the
#: record's bytes), each taken by the retention run after its commit (a few, bounded).
_committed: OrderedDict[str, bytes] = OrderedDict()
_committed_lock = threading.Lock()  # the save thread notes, the retention thread takes
_COMMITTED_KEPT = 4


def note_committed(location: str, record: bytes) -> None:
    """The save thread, after the commit of ``location`` (a step directory's URI, as its store
    names it): the record as committed, for :func:`apply_retention` to take instead of reading it
    back (issue 37: one ``GetObject`` a save on S3). The record the save wrote is the step's
    newest; retention is the only reader that wants it, and judges it afresh as before."""
    with _committed_lock:
        _committed[location.rstrip("/")] = record
        while len(_committed) > _COMMITTED_KEPT:  # a chain that never retains (two tiers) leaves them
            _committed.popitem(last=False)


def _take_committed(root: Store, up_to: int) -> dict[int, bytes]:
    """The records noted for steps directly under ``root`` up to ``up_to`` (step -> bytes),
    taken. Those of later steps stay for their own run (a save that committed after this run
    picked its step: this run's listing may not show its record yet)."""
    base = root.uri.rstrip("/") + "/"
    taken: dict[int, bytes] = {}
    with _committed_lock:
        for location in [u for u in _committed if u.startswith(base)]:
            step = parse_step_dir(location[len(base) :])
            if step is not None and step <= up_to:
                taken[step] = _committed.pop(location)
    return taken


def delete_step(root: Store, step: int, files: list[str]) -> None:
    """Delete the checkpoint of ``step``: the commit record first, so that an interrupted deletion
    leaves an incomplete checkpoint (ignored, cleaned up later), never a manifest that points at
    missing files. The data files go in batches where the store can (S3: 1,000 per request,
    :func:`~goodput_ckpt.storage.bulk.delete_files`): 18 requests for a 16,384-rank step instead
    of 16,385."""
    name = step_dir_name(step)
    if MANIFEST_NAME in files:
        root.delete(f"{name}/{MANIFEST_NAME}")  # alone, and before the files it commits
    delete_files(root, [f"{name}/{f}" for f in files if f != MANIFEST_NAME])
    logger.info("deleted the checkpoint of step %d under %s", step, root.uri)


def clean_before_restore(
    root: Store,
    *,
    keep_last: int | None,
    fresh_start: list[str] | None = None,
    records: dict[int, bytes] | None = None,
) -> int | None:
    """The coordinator's clean-up before a restore, when nothing of the job is in flight: delete
    every incomplete step (a leftover) and complete ones beyond ``keep_last`` (a run killed
    between a commit and its retention left one too many), abort the multipart uploads killed
    saves left under the root on object stores, and return the newest complete step.

    Deletions and aborts are best effort (logged). ``fresh_start``: when nothing is complete,
    what the root holds is appended to it (:func:`describe_fresh_start`), for the caller to log
    once it knows that no other tier holds a step either. ``records``: filled with the commit
    records the clean-up read (step -> bytes), so that the load of the returned step need not
    read its record again (:func:`~.agreement.agree_on_latest`).

    Raises:
        CheckpointError: the root cannot be listed.
    """
    scan = scan_steps(root)
    if fresh_start is not None and scan.latest is None:
        fresh_start.append(describe_fresh_start(root, scan))
    doomed = set(scan.incomplete)
    if scan.latest is not None:
        doomed.update(retention_victims(scan, committed=scan.latest, keep_last=keep_last))
    for s in deletion_order(
        root, scan.files, spare_referenced(root, scan, doomed, fresh=scan.complete, records=records)
    ):
        try:
            delete_step(root, s, scan.files[s])
        except CheckpointError as e:
            logger.warning("could not remove the checkpoint of step %d: %s", s, e)
    _abort_orphaned_uploads(root)
    _remove_empty_step_dirs(root)
    return scan.latest


def _remove_empty_step_dirs(root: Store) -> None:
    """Remove step directories left empty on local disk and volumes.

    Why: deleting a step removes its files, and the local store then removes the directory
    they emptied. A process killed between the two (retention cut short by SIGKILL) leaves
    an empty ``step_N`` directory; listings show only files, so no scan ever sees it, and
    nothing else would remove it. Stores without directories (S3) have nothing to remove.
    ``os.rmdir`` removes only empty directories, and links are never followed.
    """
    base = root.traits.local_path
    if base is None or not os.path.isdir(base):
        return
    try:
        entries = [
            e for e in os.scandir(base) if parse_step_dir(e.name) is not None and e.is_dir(follow_symlinks=False)
        ]
    except OSError as e:
        logger.warning("could not look for empty step directories under %s: %s", root.uri, e)
        return
    for entry in entries:
        for dirpath, _, _ in os.walk(entry.path, topdown=False):  # innermost first; links not followed
            try:
                os.rmdir(dirpath)
                logger.info("removed the empty directory %s (a deletion cut short)", dirpath)
            except OSError:
                pass  # not empty: a step with files, which the scan handles


def _abort_orphaned_uploads(root: Store) -> None:
    """On object stores, abort every multipart upload open under the root (they cost storage and
    are invisible to listings). One job writes a root at a time and nothing of it is in flight,
    so every open upload is an orphan."""
    if not isinstance(root, StaleUploads):
        return
    try:
        aborted = root.abort_stale_uploads(older_than=0, recursive=True)
    except CheckpointError as e:
        logger.warning("could not clean up unfinished uploads under %s: %s", root.uri, e)
        return
    if aborted:
        logger.info("aborted %d unfinished upload(s) under %s left by interrupted saves", len(aborted), root.uri)


def describe_fresh_start(root: Store, scan: StepScan) -> str:
    """What a restore found under ``root`` when nothing there is complete (``scan``: its listing
    before the clean-up), for the warning that training starts from step 0.

    Why: a mistyped or wrong root made ``restore()`` return ``None`` in silence, and the job
    trained from scratch. A root that does not exist, one that holds files but no step
    directory (a wrong root: a parent, or a step directory itself), and one that holds only
    incomplete saves (every save was interrupted or failed) are told apart. ``root.uri`` is
    redacted (credentials never reach a message).
    """
    if scan.incomplete:
        steps = ", ".join(str(s) for s in scan.incomplete[:5]) + (", ..." if len(scan.incomplete) > 5 else "")
        held = (
            f"holds no complete checkpoint, only {len(scan.incomplete)} incomplete save(s) (step {steps}: "
            "interrupted or failed, now deleted)"
        )
    else:
        held = "holds no checkpoint"
        base = root.traits.local_path
        if base is not None and not os.path.exists(base):
            held = "does not exist"
        elif base is not None and os.path.isdir(base):
            try:
                from .job import JOB_FILE  # here: job.py lists steps through this module

                others = len([n for n in os.listdir(base) if n not in (TIMELINE_NAME, JOB_FILE)])
            except OSError:
                others = 0
            if others:
                held = f"holds {others} entr{'y' if others == 1 else 'ies'} but no step_* checkpoint (is it the right root?)"
    return f"{root.uri} {held}"
