"""Simulated DCP saves for the coordinator's tests: the ``Metadata`` and write results every rank
hands to ``finish``, built without a process group (tests/dcp/test_item_entries.py and
tests/engine/test_group_grids.py both check the item entries against them)."""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from goodput_ckpt.dcp.commit_build import RANK_WRITES_KEY, rank_writes
from goodput_ckpt.format.manifest import ALIGNMENT, FileEntry

__all__ = ["Box", "fsdp", "save", "split"]

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, rank


def split(n: int, parts: int) -> list[tuple[int, int]]:
    c = -(-n // parts)
    return [(o, min(c, n - o)) for o in range(0, n, c)]


def fsdp(shape: tuple[int, ...], world: int) -> list[Box]:
    rest = shape[1:]
    return [((o,) + (0,) * len(rest), (n,) + rest, r) for r, (o, n) in enumerate(split(shape[0], world))]


def save(
    world: int,
    tensors: dict[str, tuple[tuple[int, ...], list[Box]]],
    objects: dict[str, list[int]] | None = None,
    plain=(),
):
    """Metadata and results as DCP hands them to finish, each rank's items laid out in one file
    (its own items first, as the writer does: objects and the tensors named in ``plain``, which
    are not shards of a distributed tensor), and where every chunk went."""
    ends = [0] * world
    per_rank: list[list] = [[] for _ in range(world)]
    sd_md: dict = {}
    where: dict = {}

    def place(rank: int, length: int) -> int:
        off = -(-ends[rank] // ALIGNMENT) * ALIGNMENT
        ends[rank] = off + length
        return off

    for key, ranks in (objects or {}).items():
        sd_md[key] = BytesStorageMetadata()
        for r in ranks:
            off = place(r, 100 + r)
            per_rank[r].append(((key, None, 0, off, 100 + r), None))
            where[key] = (r, off, 100 + r)  # the last rank's, as DCP keeps one
    own = [len(items) for items in per_rank]
    for key, (_shape, boxes) in sorted(tensors.items(), key=lambda kv: kv[0] not in plain):
        chunks = []
        for offsets, sizes, r in boxes:
            n = math.prod(sizes) * 4
            off = place(r, n)
            per_rank[r].append(((key, offsets, 0, off, n), sizes))
            own[r] += key in plain
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            where[key, offsets] = (r, off, n)
    for key, (shape, boxes) in tensors.items():  # DCP's order: the state dict's
        chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(sz)) for o, sz, _ in boxes]
        sd_md[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)
    results = []
    for r, items in enumerate(per_rank):
        files = (FileEntry(f"rank{r}.bin", ends[r], ("0" * 64,) * -(-ends[r] // (1 << 20))),) if items else ()
        rw = rank_writes(files, [w for w, _ in items], [s for _, s in items], own=own[r])
        results.append([WriteResult(index=MetadataIndex(RANK_WRITES_KEY), size_in_bytes=ends[r], storage_data=rw)])
    return Metadata(state_dict_metadata=sd_md), results, where
