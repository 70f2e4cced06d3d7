"""Peer moves of data files (a replica's way between nodes): multi-chunk files cross two real
gloo ranks and arrive byte for byte, a damaged chunk fails its file by name and byte range with
nothing of it left, and the ranks stay in step for the next move."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.dist import run_ranks

from goodput_ckpt import CheckpointWriter
from goodput_ckpt.format.manifest import MANIFEST_NAME, parse_manifest

CHUNK = 4096
DAMAGED_CHUNK = 3


def _worker(rank: int, world: int, base: str, in_memory: bool = False) -> None:
    from goodput_ckpt.format.commit_record import KeyIndex
    from goodput_ckpt.manager.tiers.file_moves import Move, ReceivedFiles, run_moves
    from goodput_ckpt.storage import open_store

    manifest = parse_manifest(Path(base, "full", MANIFEST_NAME).read_bytes())
    a, b, c = sorted(manifest.files)
    moves = [Move(0, 1, manifest.files[a]), Move(0, 1, manifest.files[b]), Move(1, 0, manifest.files[c])]
    into = ReceivedFiles("received", manifest.chunk_size) if in_memory else None
    if in_memory:  # of b, only chunks 0 and 2 (what a rank reads of it)
        moves[1] = Move(0, 1, manifest.files[b], frozenset({0, 2}))
    failed = run_moves(
        moves,
        rank=rank,
        store=open_store(str(Path(base, f"rank{rank}"))),
        chunk_size=manifest.chunk_size,
        pg=dist.group.WORLD,
        sender_uri="the copy of rank {rank}",
        keys=KeyIndex(manifest),
        into=into,
    )
    Path(base, f"failed{rank}.json").write_text(
        json.dumps({k: [str(v), list(v.byte_range)] for k, v in failed.items()})
    )
    if into is not None:  # what a load would read: through each file's source, in ranged reads
        from goodput_ckpt.errors import IncompleteCheckpointError

        cs = manifest.chunk_size
        for name in into.files:
            source = into.open_source(name)
            if name == b:
                first, third = bytearray(cs - 5), bytearray(cs)
                source.read_into(5, [first])
                source.read_into(2 * cs, [memoryview(third)[:100], memoryview(third)[100:]])
                Path(base, f"memory{rank}-{name}").write_bytes(bytes(first + third))
                try:
                    source.read_into(cs - 8, [bytearray(16)])  # runs into chunk 1, not received
                except IncompleteCheckpointError:
                    Path(base, f"refused{rank}").write_text("yes")
                continue
            size = manifest.files[name].size
            head, tail = bytearray(size // 3), bytearray(size - size // 3)
            source.read_into(0, [head])
            source.read_into(size // 3, [tail])
            Path(base, f"memory{rank}-{name}").write_bytes(bytes(head + tail))


def _setup(tmp_path: Path) -> tuple[Path, str, str, str]:
    full = tmp_path / "full"
    g = torch.Generator().manual_seed(0)
    # 3 files of about 10.5 chunks each: several chunks in flight, a short last one.
    state = {f"t{i}": torch.randn(10 * CHUNK // 4 + 100, generator=g) for i in range(3)}
    dcp.save(state, storage_writer=CheckpointWriter(full, chunk_size=CHUNK, files_per_rank=3), no_dist=True)
    manifest = parse_manifest((full / MANIFEST_NAME).read_bytes())
    a, b, c = sorted(manifest.files)
    assert all(manifest.files[n].size > 10 * CHUNK for n in (a, b, c))
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank1").mkdir()
    for name in (a, b):
        shutil.copy(full / name, tmp_path / "rank0" / name)
    shutil.copy(full / c, tmp_path / "rank1" / c)
    damaged = bytearray((tmp_path / "rank0" / b).read_bytes())
    damaged[DAMAGED_CHUNK * CHUNK + 7] ^= 0x01  # the sender's copy of b, in its chunk 3
    (tmp_path / "rank0" / b).write_bytes(bytes(damaged))
    return full, a, b, c


def _both(rank: int, world: int, to_disk: str, into_memory: str) -> None:
    """Both tests' moves in one gloo job (a process group costs 10-30 s to start on 2 cores)."""
    _worker(rank, world, to_disk)
    _worker(rank, world, into_memory, True)


@pytest.fixture(scope="module")
def moved(tmp_path_factory) -> dict[str, tuple[Path, tuple[Path, str, str, str]]]:
    """ "disk" and "memory": (the test's directory, ``_setup``'s result) after its moves ran."""
    dirs = {kind: tmp_path_factory.mktemp(kind) for kind in ("disk", "memory")}
    setups = {kind: _setup(d) for kind, d in dirs.items()}
    run_ranks(_both, 2, str(dirs["disk"]), str(dirs["memory"]), report_dir=dirs["disk"] / "report")
    return {kind: (dirs[kind], setups[kind]) for kind in dirs}


def test_moves_arrive_exact_and_a_damaged_chunk_fails_only_its_file(moved) -> None:
    tmp_path, (full, a, b, c) = moved["disk"]

    assert (tmp_path / "rank1" / a).read_bytes() == (full / a).read_bytes()
    assert (tmp_path / "rank0" / c).read_bytes() == (full / c).read_bytes()  # after the failed move: still in step
    assert not (tmp_path / "rank1" / b).exists()  # nothing of a damaged file is left
    failed0 = json.loads((tmp_path / "failed0.json").read_text())
    failed1 = json.loads((tmp_path / "failed1.json").read_text())
    assert failed0 == {} and list(failed1) == [b]
    message, byte_range = failed1[b]
    assert byte_range == [DAMAGED_CHUNK * CHUNK, (DAMAGED_CHUNK + 1) * CHUNK], message
    assert b in message and "the copy of rank 0" in message, message


def test_moves_into_memory_arrive_exact_and_write_nothing(moved) -> None:
    """``into=ReceivedFiles``: what a rank receives (whole files, or only some chunks) is kept in
    memory and read back exactly through its source; bytes of a chunk not received cannot be
    read; nothing is written to the receiver's store. Nothing is checked on arrival (the
    reader checks what it reads): the sender's damaged chunk 3 of b was not sent."""
    tmp_path, (full, a, b, c) = moved["memory"]
    assert (tmp_path / f"memory1-{a}").read_bytes() == (full / a).read_bytes()
    assert (tmp_path / f"memory0-{c}").read_bytes() == (full / c).read_bytes()
    want_b = (full / b).read_bytes()
    assert (tmp_path / f"memory1-{b}").read_bytes() == want_b[5:CHUNK] + want_b[2 * CHUNK : 3 * CHUNK]
    assert (tmp_path / "refused1").exists()
    assert sorted(p.name for p in (tmp_path / "rank1").iterdir()) == [c]  # its own file only
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == [a, b]
    assert json.loads((tmp_path / "failed1.json").read_text()) == {}
