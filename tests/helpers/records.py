"""Commit records for tests that plant steps by hand."""

from __future__ import annotations

from goodput_ckpt.format.manifest import Manifest


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
