"""Job identity: which job a checkpoint belongs to, and how many saves it has made.

Why: node-local directories are reused across jobs on every cluster, and a persistent root can
be wiped or replaced while node-local copies remain. Without an identity, a new job restores
another job's weights from a reused ``local_dir`` and believes they are its own. So:

- The persistent root holds the job's identity, ``ROOT/goodput-job.json`` (:data:`JOB_FILE`): a
  random id, written once by the coordinator before the job's first save. A job restarted on
  the same root reads it back and is the same job; a new root (or a wiped one) makes a new job.
- Every commit record the manager writes carries ``metadata["job"] = {"id": ..., "save": n}``
  (:func:`job_metadata`): the job's id, and the job's save sequence number ``n`` (1, 2, ...
  across restarts). Replicas and persisted copies are the same bytes, so they carry it too.
- The node-local tier of a job is its own sub-directory, ``LOCAL_DIR/job-<id>`` (:func:`job_dir_name`):
  two jobs on one node never see, overwrite or delete each other's steps, and anything else in
  ``LOCAL_DIR`` is another job's (named in one warning, never deleted).

The save sequence number is what makes ``persist_every`` survive restarts: the saves committed
since the newest persisted one are ``n(newest local) - n(newest persisted)``, read from what the
tiers hold instead of a counter that every new process starts at zero. No torch here.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from ..format.commit_record import COMMITTED, read_commit_record
from ..format.json_document import parse_json_document
from ..format.manifest import Manifest
from ..storage.base import BackgroundCommit, Store
from .retention import scan_steps
from .step_layout import child_uri, parse_step_dir, step_dir_name

__all__ = [
    "JOB_DIR_PREFIX",
    "JOB_FILE",
    "JOB_KEY",
    "JobRecord",
    "JobState",
    "claim_job_file",
    "foreign_entries",
    "job_dir_name",
    "job_metadata",
    "job_of",
    "local_job_dir",
    "new_job_id",
    "newest_save",
    "read_job_file",
    "survey_job",
]

#: The job's identity at the persistent root.
JOB_FILE = "goodput-job.json"
#: The manifest metadata key of a commit record's job.
JOB_KEY = "job"
#: A job's node-local sub-directory is ``JOB_DIR_PREFIX + id``.
JOB_DIR_PREFIX = "job-"
#: What :data:`JOB_FILE` says it is (a file of that name that says otherwise is not ours).
JOB_FORMAT = "goodput-ckpt job"
JOB_FILE_VERSION = 1
#: The job file is a few dozen bytes; anything larger is not one (read bounded).
JOB_FILE_LIMIT = 4096
#: 128 random bits, lower-case hex: collisions between jobs are out of the question.
_JOB_ID = re.compile(r"[0-9a-f]{32}\Z")
#: The largest save sequence number accepted from a record (a bound, not a real limit).
MAX_SAVE_SEQ = 2**62


def new_job_id() -> str:
    """A fresh job id: 128 random bits as 32 lower-case hex digits."""
    return secrets.token_hex(16)


def is_job_id(value: Any) -> bool:
    return isinstance(value, str) and _JOB_ID.match(value) is not None


def job_dir_name(job_id: str) -> str:
    """The node-local sub-directory of job ``job_id``."""
    if not is_job_id(job_id):
        raise ValueError(f"not a job id: {job_id!r}")
    return JOB_DIR_PREFIX + job_id


def read_job_file(root: Store) -> str | None:
    """The job id recorded at ``root``, or ``None`` when there is no job file.

    Raises:
        CorruptCheckpointError: a job file that is not one of ours (too large, not JSON, another
            format, a malformed id): the root is refused rather than adopted.
        CheckpointError: the root cannot be read, or its job file is of a version this library
            does not read.
    """
    data = root.read_small(JOB_FILE, max_bytes=JOB_FILE_LIMIT)
    if data is None:
        return None
    where = f"{root.uri.rstrip('/')}/{JOB_FILE}"
    doc = parse_json_document(data, where, format_name=JOB_FORMAT, version=JOB_FILE_VERSION, what="job file")
    job_id = doc.get("id")
    if not is_job_id(job_id):
        raise CorruptCheckpointError(f"{where}: the job id is malformed", path=where)
    return job_id


def claim_job_file(root: Store, job_id: str) -> str:
    """Record ``job_id`` at ``root`` unless a job file is already there; return the id the root
    holds afterwards (ours, or the one another process wrote first).

    Raises:
        CheckpointError: the root cannot be written or read back.
    """
    data = json.dumps({"format": JOB_FORMAT, "version": JOB_FILE_VERSION, "id": job_id}).encode()
    root.prepare()
    try:
        root.put_commit_record(JOB_FILE, data, replace=False)
        if isinstance(root, BackgroundCommit):  # a staged volume writes it in the background
            root.durable_future().result()
    except CheckpointExistsError:
        pass  # another process of this root got there first: its id is the root's
    found = read_job_file(root)
    if found is None:
        raise CheckpointError(f"{root.uri}: the job file vanished right after it was written", path=root.uri)
    return found


@dataclass(frozen=True)
class JobRecord:
    """A commit record's job: its id and save sequence number (``None`` where a record written
    before job identities existed lacks them)."""

    id: str | None
    save: int | None


def job_metadata(job_id: str, save: int) -> dict[str, Any]:
    """The manifest metadata entry of a save: ``{JOB_KEY: {"id": job_id, "save": save}}``."""
    return {JOB_KEY: {"id": job_id, "save": save}}


def job_of(manifest: Manifest, where: str) -> JobRecord:
    """The job a commit record belongs to (type- and range-checked); ``where`` names the
    checkpoint in messages.

    Raises:
        CorruptCheckpointError: the record's job entry is malformed.
    """
    entry = manifest.metadata.get(JOB_KEY)
    if entry is None:
        return JobRecord(None, None)
    if not isinstance(entry, dict) or not is_job_id(entry.get("id")):
        raise CorruptCheckpointError(f"{where}: manifest metadata '{JOB_KEY}' is malformed", path=where)
    save = entry.get("save")
    if isinstance(save, bool) or not isinstance(save, int) or not 1 <= save <= MAX_SAVE_SEQ:
        raise CorruptCheckpointError(
            f"{where}: manifest metadata '{JOB_KEY}': save number {save!r} out of range", path=where
        )
    return JobRecord(entry["id"], save)


#: How many of a tier's newest committed steps :func:`newest_save` reads before giving up (a
#: step whose record cannot be read is passed; reading every step would cost a record each).
SURVEY_READS = 4


def newest_save(store: Store, job_id: str) -> int:
    """The save number of the newest committed step of job ``job_id`` in the manager root
    ``store`` (a tier), or 0 when none is found among its :data:`SURVEY_READS` newest steps.

    A record of another job, or without a job entry (written before job identities), counts as
    save 0 there: it is not this job's count. Never raises for a damaged record (it is passed).

    Raises:
        CheckpointError: ``store`` cannot be listed.
    """
    for step in list(reversed(scan_steps(store).complete))[:SURVEY_READS]:
        try:
            record = read_commit_record(store, step_dir_name(step), count_files=False)
            if record.status != COMMITTED:
                continue
            job = job_of(record.manifest, record.uri)
        except CheckpointError:
            continue
        return job.save if job.id == job_id and job.save is not None else 0
    return 0


def local_job_dir(node_dir: str, job_id: str | None) -> str:
    """A job's node-local tier inside the node directory ``node_dir`` (``None``: a root written
    before job identities kept its node-local steps in ``node_dir`` itself)."""
    return node_dir if job_id is None else child_uri(node_dir, job_dir_name(job_id))


def foreign_entries(node_dir: str, job_id: str) -> list[str]:
    """What ``node_dir`` (a local directory) holds besides job ``job_id``'s tier: other jobs'
    tiers (``job-...``) and step directories written before job identities, sorted (empty when
    ``node_dir`` does not exist). Links are not followed."""
    mine = job_dir_name(job_id)
    try:
        entries = list(os.scandir(node_dir))
    except OSError:
        return []
    found = []
    for e in entries:
        if e.name == mine or not e.is_dir(follow_symlinks=False):
            continue
        if (e.name.startswith(JOB_DIR_PREFIX) and is_job_id(e.name[len(JOB_DIR_PREFIX) :])) or parse_step_dir(
            e.name
        ) is not None:
            found.append(e.name)
    return sorted(found)


@dataclass
class JobState:
    """What a manager knows of its job (the same on every rank): its id, whether the root records
    it yet, the save number its next save gets, and the save number of the newest step handed
    to the persistent tier (two tiers)."""

    id: str
    recorded: bool
    next_save: int = 1
    persisted_save: int = 0

    def claim(self, root: Store, is_coordinator: bool) -> None:
        """Before the job's first save: the coordinator records the job's id at ``root``.

        Raises:
            CheckpointError: another job claimed the root after this one started.
        """
        if self.recorded:
            return
        if is_coordinator:
            found = claim_job_file(root, self.id)
            if found != self.id:
                raise CheckpointError(
                    f"{root.uri} was claimed by another job (id {found}) after this one started: "
                    "two jobs cannot share a root",
                    path=root.uri,
                )
        self.recorded = True

    def restored(self, job: JobRecord) -> None:
        """After a step of ``job`` was restored: this job's saves go on from its save number."""
        if job.id == self.id and job.save is not None:
            self.next_save = job.save + 1
            self.persisted_save = min(self.persisted_save, job.save)


def survey_job(root: Store, local_node_dir: str | None, open_tier: Any) -> JobState:
    """The coordinator's view of its job before the first save or restore: the root's id (or a
    new one, recorded at the first save), and, with two tiers, the save numbers the tiers hold
    (``local_node_dir``: the coordinator's node directory, ``None`` with one tier;
    ``open_tier(uri)``: a store of it). With one tier, save numbers go on from the restored
    step's, or start at 1 in a process that restores nothing.

    Raises:
        CheckpointError / CorruptCheckpointError: the root cannot be read, or its job file is
            not one of ours.
    """
    job_id = read_job_file(root)
    if job_id is None:
        return JobState(new_job_id(), recorded=False)
    if local_node_dir is None:
        # One tier: no persist cadence to keep, so no listing of the root here (a restore lists
        # it anyway, and its record's save number continues the count).
        return JobState(job_id, recorded=True)
    persisted = newest_save(root, job_id)
    local = newest_save(open_tier(local_job_dir(local_node_dir, job_id)), job_id)
    return JobState(job_id, recorded=True, next_save=max(local, persisted) + 1, persisted_save=persisted)
