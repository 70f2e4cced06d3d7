"""Files of failed saves inside a committed step directory, removed by retention after the commit.

Why here and not in the save (issue 37): a plain ``CheckpointWriter`` lists its location before
every save, to refuse a committed record early and to learn which files of failed saves to
delete after its commit. On S3 that listing is the one request a manager's save made above the
minimum its layout needs. A manager knows the step is new (it refuses the steps it listed at its
first save and those it committed since), so its step writers skip the listing (``known_new``:
``engine.hashed_write.clear_or_refuse_existing``), and the files a failed earlier save of the
same step left (a job that crashed mid-save and re-saves that step after its restart) are
removed here instead: retention lists the whole root after every commit anyway, so it sees them
at no extra request.

What goes, for a step whose commit record this process's save just wrote (``records``, handed
over by :func:`~.retention.note_committed`: no read back): every file the root's listing shows
in the step directory that

- the record does not list (its ``files`` table, the keys compared by name), and is not the
  record itself;
- is a name a save writes (``engine.hashed_write.is_save_file``: a data file or a temporary
  record, one path component: inside the step directory, never ``..`` or a nested path).
  Anything else in a step directory is not the writer's to delete, as it never was.

They are never part of the committed step: a reader opens only the files its record lists, and
their names carry another save's token. A crash before this runs leaves them until the step is
retired (``delete_step`` removes a step directory whole). No torch here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from ..engine.hashed_write import data_file_token, is_save_file
from ..errors import CheckpointError
from ..format.manifest import MANIFEST_NAME
from ..format.schema import FORMAT_NAME, MAX_MANIFEST_BYTES
from ..storage.base import Store, check_relative_name
from ..storage.bulk import delete_files
from .step_layout import step_dir_name

__all__ = ["leftover_files", "remove_leftovers"]

logger = logging.getLogger("goodput_ckpt.retention")


def committed_names(record: bytes) -> frozenset[str] | None:
    """The file names a commit record's ``files`` table lists, or ``None`` when ``record`` is not
    a record of this format (then nothing is deleted). ``record`` is what this process's save
    committed after validating it in full (``publish_manifest``), so its JSON alone is read
    here; the size bound still comes first."""
    if len(record) > MAX_MANIFEST_BYTES:
        return None
    try:
        doc = json.loads(bytes(record).decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME or not isinstance(doc.get("files"), dict):
        return None
    return frozenset(name for name in doc["files"] if isinstance(name, str))


def leftover_files(names: list[str], record: bytes) -> list[str]:
    """Of ``names`` (a step directory's listing, relative to it), the files of failed saves that
    the committed ``record`` does not list (see the module doc); ``[]`` when ``record`` cannot be
    read.

    The record is parsed only where another save's files can be there: every save gives all its
    data files one fresh token, so a directory whose save files are data files of one token holds
    the committed save's files alone (the common case: no JSON parse of the record per commit)."""
    tokens = {data_file_token(n) for n in names if is_save_file(n)}  # None: a temporary record
    if len(tokens) <= 1 and None not in tokens:
        return []
    keep = committed_names(record)
    if keep is None:
        return []
    return [n for n in names if n != MANIFEST_NAME and n not in keep and is_save_file(n)]


def remove_leftovers(root: Store, files: Mapping[int, list[str]], records: Mapping[int, bytes]) -> None:
    """Delete the files of failed saves in each step of ``records`` (step -> the record its save
    committed) that the listing ``files`` (step -> names, :func:`~.step_layout.list_step_dirs`)
    shows complete. Best effort: a failure is logged, and the step keeps them until retired."""
    for step, record in sorted(records.items()):
        names = files.get(step, [])
        if MANIFEST_NAME not in names:
            continue  # deleted since, or not yet listed: nothing of it is judged from this listing
        stray = leftover_files(names, record)
        if not stray:
            continue
        where = step_dir_name(step)
        try:
            for name in stray:  # proven inside the step directory before anything is deleted
                check_relative_name(name)
                if "/" in name:
                    raise CheckpointError(f"{where}/{name} is not directly inside {where}", path=root.uri)
            delete_files(root, [f"{where}/{n}" for n in stray])
        except CheckpointError as e:
            logger.warning("could not remove files of failed saves in %s under %s: %s", where, root.uri, e)
            continue
        logger.info("removed %d file(s) of failed saves from %s under %s", len(stray), where, root.uri)
