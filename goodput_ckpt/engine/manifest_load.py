"""Reading a committed manifest for a load: the commit record, judged and validated
(:func:`~goodput_ckpt.format.commit_record.read_commit_record`), and every data file's size
checked against it (:func:`~goodput_ckpt.format.commit_record.file_problems`), an incremental
save's referenced files where they live (:mod:`~goodput_ckpt.format.references`)."""

from __future__ import annotations

from ..format.commit_record import file_problems, read_commit_record
from ..format.manifest import Manifest
from ..format.references import with_references
from ..storage import Store

__all__ = ["load_manifest"]


def load_manifest(store: Store, *, check_files: bool = True, record: bytes | None = None) -> Manifest:
    """Read, parse and validate the manifest of ``store``, and check every file's size
    (``check_files=False``: a partial copy, such as a node's copy of a two-tier checkpoint, whose
    missing files are an error only when read). ``record``: the commit record's bytes when the
    caller read them already (parsed and judged the same way, not read again).

    Raises:
        CheckpointNotFoundError: nothing is stored at the location.
        IncompleteCheckpointError: files exist but no manifest does (an uncommitted save); on a
            store whose commit record is not atomic (a mounted volume), also a manifest that
            does not parse or validate.
        CorruptCheckpointError: the manifest is invalid, or a file is missing or of the wrong size.
        CheckpointError: a manifest version this library does not read; a file cannot be examined.
    """
    manifest = read_commit_record(store, data=record).manifest_or_raise()
    if check_files:
        for problem in file_problems(with_references(store, manifest), manifest):
            raise problem.error(store.uri)
    return manifest
