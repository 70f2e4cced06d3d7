"""``ls``: the checkpoints under a manager root, one per ``step_XXXXXXXX`` location.

Status of each:

- ``complete``: a manifest that parses (and, with ``verify``, whose files pass
  :func:`~goodput_ckpt.tools.verify.verify_checkpoint`);
- ``incomplete``: files but no manifest: a save that is running, failed or was interrupted; on a
  mounted volume also a manifest that does not validate (being written, or cut short);
- ``corrupt``: a manifest that does not validate where commits are atomic (local disk, S3), or
  (with ``verify``) missing, resized or damaged files;
- ``unsupported``: a manifest of a format version this library does not read.

The listing is one ``list`` of the root plus one manifest read per step (and, with ``verify``,
a full verification per complete step), so it works on any store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError
from ..format.commit_record import COMMITTED, CORRUPT, MISSING, UNSUPPORTED, read_commit_record
from ..format.manifest import MANIFEST_NAME
from ..manager.step_layout import child_uri, list_step_dirs, step_dir_name
from ._common import NO_PROGRESS, Progress, open_location, require_positive
from .verify import verify_checkpoint

__all__ = ["CheckpointRow", "ListReport", "list_checkpoints"]


@dataclass
class CheckpointRow:
    step: int
    name: str
    uri: str
    status: str
    created_at: str | None = None
    bytes: int = 0
    files: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass
class ListReport:
    """The outcome of :func:`list_checkpoints`; rows are sorted by step."""

    root: str
    verified: bool
    checkpoints: list[CheckpointRow] = field(default_factory=list)

    @property
    def latest_complete(self) -> int | None:
        done = [c.step for c in self.checkpoints if c.status == "complete"]
        return max(done) if done else None


def list_checkpoints(
    root: str,
    *,
    verify: bool = False,
    quick: bool = False,
    thread_count: int | None = None,
    progress: Progress = NO_PROGRESS,
    **options: Any,
) -> ListReport:
    """List the checkpoints under the manager root ``root``.

    Args:
        verify: verify every complete checkpoint (hashes; sizes only with ``quick``), so that
            damaged ones show as ``corrupt``.
        **options: backend options for the store.

    Raises:
        CheckpointNotFoundError: ``root`` holds nothing.
    """
    require_positive("thread_count", thread_count)
    store = open_location(root, options)
    names = store.list()
    if not names:
        raise CheckpointNotFoundError(f"no checkpoints under {store.uri}: it is empty or does not exist", path=store.uri)
    report = ListReport(root=store.uri, verified=verify)
    steps = list_step_dirs(store)
    if not steps and MANIFEST_NAME in names:
        raise CheckpointNotFoundError(
            f"{store.uri} is a checkpoint, not a manager root of step_XXXXXXXX checkpoints; "
            "use `goodput-ckpt inspect` or `verify` on it",
            path=store.uri,
        )
    for step, files in steps.items():
        name = step_dir_name(step)
        row = CheckpointRow(step=step, name=name, uri=child_uri(store.uri, name), status="incomplete")
        report.checkpoints.append(row)
        record = read_commit_record(store, name, location=row.uri, listing=files)
        if record.status == MISSING:  # (or removed since the listing: retention, overwrite)
            row.files = len(files)
            row.bytes = _sizes(store, name, files)
        if record.status != COMMITTED:
            row.status = {CORRUPT: "corrupt", UNSUPPORTED: "unsupported"}.get(record.status, "incomplete")
            row.problems.append(record.message)
            continue
        manifest = record.manifest
        row.status = "complete"
        row.created_at = manifest.created_at
        row.files = len(manifest.files)
        row.bytes = manifest.total_bytes() + record.record_bytes
        if verify:
            result = verify_checkpoint(row.uri, quick=quick, thread_count=thread_count, progress=progress, **options)
            if not result.ok:
                row.status = "corrupt" if result.status != "incomplete" else "incomplete"
                row.problems.extend(p.message for p in result.problems)
    return report


def _sizes(store, name: str, files: list[str]) -> int:
    total = 0
    for f in files:
        try:
            total += store.size(f"{name}/{f}") or 0
        except CheckpointError:
            pass
    return total
