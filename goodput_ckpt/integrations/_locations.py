"""Checkpoint locations as trainers see them: which ones under a root are committed, and how one
is removed. Shared by the adapters (Lightning's ``remove_checkpoint``, the Hugging Face Trainer's
``save_total_limit`` rotation and its ``resume_from_checkpoint=True`` search), so that every
adapter deletes only what is provably ours and finds the newest checkpoint the same way.

No torch and no trainer library here: only stores and commit records.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from ..engine.hashed_write import clear_or_refuse_existing, remove_stale_files
from ..format.commit_record import COMMITTED, MISSING, read_commit_record
from ..format.manifest import MANIFEST_NAME
from ..manager.step_layout import child_uri
from ..storage import open_store

__all__ = ["committed_numbered", "is_committed", "is_plain_file", "record_status", "remove_location"]

logger = logging.getLogger("goodput_ckpt.integrations")


def is_plain_file(path: str | os.PathLike) -> bool:
    """A local path (no URL scheme) that is a regular file: another format's checkpoint."""
    text = os.fspath(path)
    return "://" not in str(text) and os.path.isfile(text)


def record_status(uri: str | os.PathLike, options: Mapping[str, Any] | None = None) -> str:
    """The status of ``uri``'s commit record (``missing`` for a single file): ``committed``, or
    why it is not (:mod:`..format.commit_record`).

    Raises:
        CheckpointError: the store cannot be read at all (permissions, network).
    """
    if is_plain_file(uri):
        return MISSING
    return read_commit_record(open_store(uri, options), count_files=False).status


def is_committed(uri: str | os.PathLike, options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``uri`` holds a committed checkpoint of ours (a valid commit record)."""
    return record_status(uri, options) == COMMITTED


def committed_numbered(
    root: str | os.PathLike, prefix: str, options: Mapping[str, Any] | None = None
) -> dict[int, str]:
    """The committed checkpoints named ``<prefix><number>`` directly under ``root``, from one
    listing: number -> URI, sorted by number.

    A location whose record is missing, torn, damaged or of an unknown version is left out and
    logged: a save killed half-way must not be the one a resume picks (the Trainer's own
    ``get_last_checkpoint`` takes the highest-numbered directory, whatever it holds).

    Raises:
        CheckpointError: the store cannot be listed at all.
    """
    pattern = re.compile(re.escape(prefix) + r"(\d{1,18})\Z")
    store = open_store(root, options)
    found: dict[int, str] = {}
    for name in store.list():
        head, sep, rest = name.partition("/")
        m = pattern.match(head)
        if not sep or rest != MANIFEST_NAME or m is None:
            continue
        record = read_commit_record(store, head, count_files=False)
        if record.status == COMMITTED:
            found[int(m.group(1))] = child_uri(str(root), head)
        else:
            logger.warning("skipping %s: its commit record is %s", record.uri, record.status)
    return dict(sorted(found.items()))


def remove_location(path: str | os.PathLike, options: Mapping[str, Any] | None = None) -> bool:
    """Delete the checkpoint at ``path``; ``True`` when it was ours and is gone.

    Removes only what is provably ours: the commit record first (so that an interrupted removal
    leaves a visibly incomplete location, never a record pointing at missing files), then the
    data files it lists that have the recorded sizes, then files named as our writers name data
    files. A location without our commit record, or a single file, is left alone and logged. The
    directory itself goes when it is left empty (local disk, volumes).

    Raises:
        CheckpointError: the store cannot be read or a deletion failed.
    """
    if is_plain_file(path):
        logger.warning("not removing %s: a single file, not a goodput-ckpt checkpoint location", os.fspath(path))
        return False
    store = open_store(path, options)
    record = read_commit_record(store, count_files=False)
    if record.status == MISSING:
        logger.warning("not removing %s: it holds no goodput-ckpt commit record", store.uri)
        return False
    clear_or_refuse_existing(store, overwrite=True)
    remove_stale_files(store, keep=set())
    local = store.traits.local_path
    if local is not None:
        try:
            os.rmdir(local)  # only when empty: anything left is not provably ours
        except OSError as e:
            logger.info("left the directory %s in place: %s", local, e)
    return True
