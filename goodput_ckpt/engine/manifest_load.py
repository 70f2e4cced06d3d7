"""Reading a committed manifest for a load: the commit record, judged and validated
(:func:`~goodput_ckpt.format.commit_record.read_commit_record`), and every data file's size
checked against it (:func:`~goodput_ckpt.format.commit_record.file_problems`): the location's
own files; an incremental save's referenced files (:mod:`~goodput_ckpt.format.references`) are
checked as they are read, chunk by chunk against their digests."""

from __future__ import annotations

from ..format.commit_record import file_problems, read_commit_record
from ..format.manifest import Manifest
from ..storage import Store

__all__ = ["load_manifest"]


def load_manifest(store: Store, *, check_files: bool = True) -> Manifest:
    """Read, parse and validate the manifest of ``store``, and check every file's size
    (``check_files=False``: a partial copy, such as a node's copy of a two-tier checkpoint, whose
    missing files are an error only when read).

    Raises:
        CheckpointNotFoundError: nothing is stored at the location.
        IncompleteCheckpointError: files exist but no manifest does (an uncommitted save); on a
            store whose commit record is not atomic (a mounted volume), also a manifest that
            does not parse or validate.
        CorruptCheckpointError: the manifest is invalid, or a file of the location is missing or of
            the wrong size (a referenced file: when read).
        CheckpointError: a manifest version this library does not read; a file cannot be examined.
    """
    manifest = read_commit_record(store).manifest_or_raise()
    if check_files:
        # Referenced files are checked as they are read (their digests), not with a request
        # each beforehand (file_problems: referenced=False).
        for problem in file_problems(store, manifest, referenced=False):
            raise problem.error(store.uri)
    return manifest
