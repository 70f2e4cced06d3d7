"""``ls``: the checkpoints under a manager root, one per ``step_XXXXXXXX`` (or ``step_N``) location.

Status of each:

- ``complete``: a manifest that parses (and, with ``verify``, whose files pass
  :func:`~goodput_ckpt.tools.ops.verify.verify_checkpoint`);
- ``incomplete``: files but no manifest: a save that is running, failed or was interrupted; on a
  mounted volume also a manifest that does not validate (being written, or cut short);
- ``corrupt``: a manifest that does not validate where commits are atomic (local disk, S3), or
  (with ``verify``) missing, resized or damaged files;
- ``unsupported``: a manifest of a format version this library does not read.

The listing is one ``list`` of the root plus one manifest read per step (and, with ``verify``,
a full verification per complete step), so it works on any store.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ...errors import CheckpointError, CheckpointNotFoundError
from ...format.commit_record import COMMITTED, CORRUPT, MISSING, UNSUPPORTED, foreign_layout_message, read_commit_record
from ...format.manifest import MANIFEST_NAME
from ...manager.step_layout import child_uri
from .._common import NO_PROGRESS, Progress, open_location, refuse_plain_file, require_positive
from .verify import verify_checkpoint

__all__ = ["CheckpointRow", "ListReport", "list_checkpoints"]


@dataclass
class CheckpointRow:
    step: int
    name: str
    uri: str
    status: str
    created_at: str | None = None
    bytes: int = 0  # what the step's location holds (its record included)
    files: int = 0
    problems: list[str] = field(default_factory=list)
    #: Bytes the step uses from earlier steps' files (an incremental save's references).
    referenced: int = 0
    tiers: list[str] = field(default_factory=list)  # with a local_dir: "persistent", "node 0", ...


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
    local_dir: str | None = None,
    **options: Any,
) -> ListReport:
    """List the checkpoints under the manager root ``root``.

    Args:
        local_dir: the node-local tier of a two-tier manager (``{node}`` allowed): each row
            then says which tiers hold a committed copy (``tiers``), and steps held only on
            the local tier get a row of status ``local`` (a node's copy holds only that node's
            files and replicas, so it is not verified here).
        verify: verify every complete checkpoint (hashes; sizes only with ``quick``), so that
            damaged ones show as ``corrupt``.
        **options: backend options for the store.

    Step directories are the manager's ``step_00001000`` and any other ``step_N`` (a
    hand-written ``step_100``, as the README's quick start saves).

    Raises:
        CheckpointNotFoundError: ``root`` holds nothing, or no step directory (another tool's
            checkpoint is named), or is a checkpoint itself.
    """
    require_positive("thread_count", thread_count)
    store = open_location(root, options)
    refuse_plain_file(store)
    names = store.list()
    local = _local_steps(local_dir, _job_of_root(store)) if local_dir is not None else {}
    if not names and local:
        names = []
    elif not names:
        raise CheckpointNotFoundError(
            f"no checkpoints under {store.uri}: it is empty or does not exist", path=store.uri
        )
    report = ListReport(root=store.uri, verified=verify)
    steps = _step_dirs(store, names)
    if not steps and local:
        pass
    elif not steps and MANIFEST_NAME in names:
        raise CheckpointNotFoundError(
            f"{store.uri} is a checkpoint, not a manager root of step_XXXXXXXX checkpoints; "
            "use `goodput-ckpt inspect` or `verify` on it",
            path=store.uri,
        )
    if not steps and not local:
        others = sorted({n.split("/", 1)[0] for n in names if n.count("/") == 1 and n.endswith("/" + MANIFEST_NAME)})
        what = foreign_layout_message(store.uri, names) if not others else None
        raise CheckpointNotFoundError(
            what
            or f"no checkpoints under {store.uri}: it holds {len(names)} file(s) but no step_N directories"
            + (
                f" (checkpoints in other directories: {', '.join(others[:3])}; verify or inspect them one by one)"
                if others
                else ""
            ),
            path=store.uri,
        )
    for (step, name), files in steps.items():
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
        row.bytes = manifest.written_bytes() + record.record_bytes
        row.referenced = manifest.referenced_bytes()
        if verify:
            result = verify_checkpoint(row.uri, quick=quick, thread_count=thread_count, progress=progress, **options)
            if not result.ok:
                row.status = "corrupt" if result.status != "incomplete" else "incomplete"
                row.problems.extend(p.message for p in result.problems)
    if local_dir is not None:
        _add_local(report, local)
    return report


def _job_of_root(store: Any) -> str | None:
    """The id of the job the root belongs to (``None``: no job file, or an unreadable one, which
    the listing of the root itself reports)."""
    from ...manager.job import read_job_file

    try:
        return read_job_file(store)
    except CheckpointError:
        return None


def _local_steps(template: str, job_id: str | None) -> dict[int, list[tuple[int, str, Any]]]:
    """Step -> (node, its local location, its manifest) for every committed node copy of the
    root's job (``job_id``; ``None``: a root from before job identities, whose node copies lie
    in the node directories themselves)."""
    from ...manager.job import local_job_dir
    from ...manager.step_layout import list_step_dirs, step_dir_name
    from ...manager.tiers.nodes import node_dirs
    from ...storage import open_store

    try:
        nodes = node_dirs(template)
    except ValueError as e:
        raise CheckpointError(f"--local-dir: {e}") from None
    out: dict[int, list[tuple[int, str, Any]]] = {}
    for node, path in nodes.items():
        local = open_store(local_job_dir(path, job_id), {})
        for step, files in list_step_dirs(local).items():
            record = read_commit_record(local, step_dir_name(step), listing=files)
            if record.status == COMMITTED:
                out.setdefault(step, []).append((node, child_uri(local.uri, step_dir_name(step)), record.manifest))
    return out


def _add_local(report: ListReport, local: dict[int, list[tuple[int, str, Any]]]) -> None:
    """Say which tiers hold each step, and add the steps only the local tier holds."""
    rows = {c.step: c for c in report.checkpoints}
    for c in report.checkpoints:
        if c.status == "complete":
            c.tiers.append("persistent")
    for step, copies in sorted(local.items()):
        row = rows.get(step)
        if row is None:
            _, uri, manifest = copies[0]
            row = CheckpointRow(
                step=step,
                name=uri.rsplit("/", 1)[-1],
                uri=uri,
                status="local",
                created_at=manifest.created_at,
                bytes=manifest.total_bytes(),
                files=len(manifest.files),
            )
            report.checkpoints.append(row)
        row.tiers.extend(f"node {node}" for node, _, _ in copies)
    report.checkpoints.sort(key=lambda c: c.step)


#: What ``ls`` takes for a step directory: the manager's ``step_00001000`` and also the
#: shorter ``step_100`` people write by hand (the README's quick start saves one).
_ANY_STEP_DIR = re.compile(r"step_(\d+)")


def _step_dirs(store, names: list[str]) -> dict[tuple[int, str], list[str]]:
    """(step, directory name) -> its files (relative), sorted by step then name, from one listing."""
    out: dict[tuple[int, str], list[str]] = {}
    for n in names:
        head, sep, rest = n.partition("/")
        m = _ANY_STEP_DIR.fullmatch(head) if sep else None
        if m is not None:
            out.setdefault((int(m.group(1)), head), []).append(rest)
    return dict(sorted(out.items()))


def _sizes(store, name: str, files: list[str]) -> int:
    total = 0
    for f in files:
        try:
            total += store.size(f"{name}/{f}") or 0
        except CheckpointError:
            pass
    return total
