"""Commit records for tests that plant steps by hand."""

from __future__ import annotations

from goodput_ckpt.format.manifest import FileEntry, Manifest
from goodput_ckpt.manager.step_layout import step_dir_name

#: A placeholder chunk digest: these records are read for their references, never verified.
DIGEST = "0" * 64


def record_referencing(bases: list[int]) -> bytes:
    """A commit record with one one-byte file in each step of ``bases`` (an incremental step's
    references; ``[]``: a full step of version 2)."""
    files = {f"f{b}.bin": FileEntry(f"f{b}.bin", 1, (DIGEST,), step_dir_name(b)) for b in bases}
    return Manifest(
        version=3 if bases else 2,
        library_version="",
        torch_version="",
        created_at="",
        world_size=1,
        chunk_size=1 << 23,
        files=files,
        items={},
    ).to_json()


def empty_record() -> bytes:
    """A valid commit record of an empty state (no files, no items, no references). Retention
    reads the records of the steps it keeps, for the steps they reference (incremental saves,
    manager/step_references.py); a planted step needs a record that parses to reference none."""
    return Manifest(
        version=2,
        library_version="",
        torch_version="",
        created_at="",
        world_size=1,
        chunk_size=1 << 23,
        files={},
        items={},
    ).to_json()
