"""A two-tier restore checks only the hash chunks a rank reads: chunks_read_by maps the load plan
to chunks, and check_file(only=) hashes those and no others."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointWriter, CorruptCheckpointError
from goodput_ckpt.dcp.needed_files import chunks_read_by
from goodput_ckpt.format.manifest import MANIFEST_NAME, parse_manifest
from goodput_ckpt.manager.tiers.file_moves import check_file
from goodput_ckpt.storage import open_store

CHUNK = 4096


def _saved(tmp_path: Path):
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(4)}  # 4 KiB each: one chunk each
    dcp.save(state, storage_writer=CheckpointWriter(tmp_path, chunk_size=CHUNK), no_dist=True)
    return state, parse_manifest((tmp_path / MANIFEST_NAME).read_bytes())


def test_chunks_read_by_names_the_chunks_of_the_items_loaded(tmp_path: Path) -> None:
    state, m = _saved(tmp_path)
    (name,) = m.files
    for key in state:
        c = m.items[key].chunks[0]
        want = set(range(c.offset // CHUNK, (c.offset + c.length - 1) // CHUNK + 1))
        assert chunks_read_by({key: torch.zeros(1024)}, m) == {name: want}
    everything = chunks_read_by({k: torch.zeros(1024) for k in state}, m)
    assert everything == {name: set(range(len(m.files[name].chunks)))}


def test_check_file_hashes_only_the_chunks_asked_for(tmp_path: Path) -> None:
    state, m = _saved(tmp_path)
    (name,) = m.files
    entry = m.files[name]
    c = m.items["t3"].chunks[0]
    damaged = c.offset // CHUNK
    with open(tmp_path / name, "r+b") as f:
        f.seek(c.offset + 10)
        f.write(b"\xff")
    store = open_store(str(tmp_path))
    others = set(range(len(entry.chunks))) - {damaged}
    check_file(store, entry, m.chunk_size, only=others)  # the damage is in a chunk not asked for
    with pytest.raises(CorruptCheckpointError, match=name):
        check_file(store, entry, m.chunk_size, only={damaged})
    with pytest.raises(CorruptCheckpointError):
        check_file(store, entry, m.chunk_size)
