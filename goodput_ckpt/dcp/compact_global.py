"""Compact save plans, the coordinator's side: the global step of a
:class:`~.save_planner.ReplicaGroupingSavePlanner` save from every rank's
:class:`~.compact_plan.CompactLocal`, without one ``WriteItem`` per rank and item.

What it decides is what the full path (the planner's ``_plan_all``: rows widened and checked,
small replicated values to the lowest rank, torch's ``DefaultSavePlanner.create_global_plan``)
decides, for the saves it can plan:

- ranks are grouped by schema digest; one schema per group is decoded, so the Python work is
  O(groups x items + ranks), and the per-chunk work (bounds, volumes, overlap) runs in numpy on
  the ranks' box tables, a block of ranks at a time;
- a value that is not a shard and that several ranks hold goes to the lowest of them (the
  planner's rule for small values, which leaves torch's dedup nothing to choose);
- the ``Metadata`` lists the keys in torch's order (first seen in rank order, each rank's items
  in its order) and each tensor's chunks as a :class:`LazyChunks`: counted now, listed only if
  read (the commit record lists the chunks of tensors that are not grids; nothing else reads
  them on a save);
- torch's validation: chunks in bounds, their volume the tensor's (``W > 1``), no two overlap.
  A tensor whose chunks tile along dimension 0 in rank order (FSDP's ``Shard(0)``) is checked in
  numpy; any other tensor's chunks are listed and checked by torch's own ``_validate_global_plan``.

It returns ``None`` (plan in full: :func:`~.compact_plan.expand`, then the full path) for what it
does not decide itself: a value that is not a shard, held by several ranks and of 1 MiB or more
(torch balances those by bytes); a key whose kind, properties or size differ between ranks
(torch's or the planner's checks then fail as they do); chunks whose volumes do not add up to the
tensor's (duplicated shards, as with HSDP, which torch's dedup removes); a shard of a 0-d or empty
tensor held more than once.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Collection, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

from ..errors import CheckpointError
from .compact_plan import BYTES, SHARD, CompactFinal, CompactLocal, Schema, decode_mappings

__all__ = ["LazyChunks", "compact_global_plan"]

#: Ranks whose box tables are stacked at once: bounds the numpy temporaries to about
#: 256 x items x 2 dims x 8 bytes (35 MB for a 70B state's 2,169 tensors).
_BLOCK = 256


class LazyChunks(Sequence):
    """A tensor's chunk list in a compact save's ``Metadata``: its length known, its
    ``ChunkStorageMetadata`` made on first read, in torch's order (rank, then the rank's item
    order). Pickles as a plain list."""

    def __init__(self, count: int, make: Any) -> None:
        self._count, self._make, self._list = count, make, None

    def _chunks(self) -> list[ChunkStorageMetadata]:
        if self._list is None:
            self._list = self._make()
            self._make = None
            if len(self._list) != self._count:
                raise CheckpointError(f"a compact save listed {len(self._list)} chunks, counted {self._count}")
        return self._list

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):  # noqa: ANN001, ANN204 - Sequence's own signature
        return self._chunks()[i]

    def __iter__(self) -> Iterator[ChunkStorageMetadata]:
        return iter(self._chunks())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (list(self._chunks()),))

    def __repr__(self) -> str:
        return f"LazyChunks({self._count})"


class _Group:
    """Ranks with one schema: its decoded columns and its members' box tables (decompressed when
    read, not kept: ``at[p]`` is item ``p``'s row in them)."""

    def __init__(self, schema: Schema, members: list[int], plans: Sequence[CompactLocal]) -> None:
        self.schema, self.members = schema, members
        self.at, self.shards = schema.shard_rows, schema.shards
        self.dims = plans[members[0]].dims
        if any(plans[m].dims != self.dims for m in members):
            raise CheckpointError("ranks with the same compact plan schema sent box tables of other widths")
        # The members' boxes only: the Metadata's lazy chunk lists keep this group alive, and
        # with it would keep every rank's schema and mappings blobs (W x 45 KB for a 70B state).
        self.boxes = {m: replace(plans[m], schema=b"", mappings=None) for m in members}

    def table(self, member: int) -> np.ndarray:
        return self.boxes[member].box_table(self.shards, member)


def compact_global_plan(
    all_plans: Sequence[SavePlan], widen: Collection[str], small: int, flatten: bool
) -> tuple[list[SavePlan], Metadata] | None:
    """The plans to scatter (each ``SavePlan([], planner_data=CompactFinal)``) and the
    ``Metadata``, or ``None`` when the save must be planned in full (module doc).

    Raises:
        CheckpointError: a compact plan that does not decode.
        ValueError: torch's validation refuses the chunks (as torch raises it).
    """
    world = len(all_plans)
    plans: list[CompactLocal] = [p.planner_data for p in all_plans]
    by_digest: dict[bytes, list[int]] = {}
    for r, p in enumerate(plans):
        by_digest.setdefault(p.schema_digest, []).append(r)
    groups = [_Group(Schema.decode(plans[m[0]].schema, m[0]), m, plans) for m in by_digest.values()]
    # -- one signature per key, the holders of each value that is not a shard ----------------------
    sig: dict[str, tuple[Any, ...]] = {}
    owner: dict[str, int] = {}
    holders: dict[str, int] = {}
    for g in groups:
        seen_own = set()
        for p, key in enumerate(g.schema.keys):
            kind = int(g.schema.kinds[p])
            s = (kind == SHARD, kind, g.schema.props[p], g.schema.sizes[p])
            if sig.setdefault(key, s) != s:
                return None  # ranks disagree on this key: the full path's checks say how
            if kind != SHARD:
                if key in seen_own:
                    return None
                seen_own.add(key)
                owner[key] = min(owner.get(key, world), g.members[0])
                holders[key] = holders.get(key, 0) + len(g.members)
    for key, n in holders.items():
        kind, props, size = sig[key][1:]
        if n > 1 and kind != BYTES and _storage(props, size) >= small:
            return None  # torch balances large replicated values by bytes: the full path
    # -- widened rows: the widest of any rank ---------------------------------------------------------
    widths: dict[str, int] = {}
    for g in groups:
        for p, key in enumerate(g.schema.keys):
            size = g.schema.sizes[p]
            if key in widen and size is not None and len(size) == 2 and size[-1] == -1:
                col = g.dims + 1
                w = max(int(g.table(m)[g.at[p], col]) for m in g.members)
                widths[key] = max(widths.get(key, 0), w)
    if widths and any(key not in _keys_of(groups, 0) for key in widths):
        return None  # rank 0 must hold every widened row: widen_rank_rows says so
    # -- chunks: counts, and torch's validation ---------------------------------------------------------
    counts, slow = _check_chunks(groups, sig, widths, world)
    if counts is None:
        return None
    # -- the Metadata: keys in torch's order, lazy chunk lists --------------------------------------------
    md: dict[str, Any] = {}
    for g in sorted(groups, key=lambda g: g.members[0]):
        for key in g.schema.keys:
            if key in md:
                continue
            shard, kind, props, size = sig[key]
            if kind == BYTES:
                md[key] = BytesStorageMetadata()
                continue
            if key in widths:
                size = (size[0], widths[key])
            md[key] = TensorStorageMetadata(
                properties=props,
                size=torch.Size(size),
                chunks=LazyChunks(counts[key], _lister(key, groups, owner, widths, world)),
            )
    metadata = Metadata(md)
    if flatten:
        metadata.planner_data = _merged_mappings(plans)
    if slow:
        errors = _validate_global_plan([None] * world, Metadata({k: md[k] for k in slow}))
        if errors:
            summary = "; ".join(errors)
            raise ValueError(f"Failed to validate global plan: {summary[:500]}")
    # -- each rank's final plan ------------------------------------------------------------------------
    props_of = {key: sig[key][2] for key in widths}
    wide = tuple((key, w, props_of[key]) for key, w in widths.items())
    nothing = np.zeros(0, dtype=np.int32).tobytes()
    out = [SavePlan([], planner_data=CompactFinal(nothing, r, world, wide)) for r in range(world)]
    for g in groups:
        own = [p for p in range(len(g.schema.keys)) if int(g.schema.kinds[p]) != SHARD]
        if not own:
            continue
        for r in {owner[g.schema.keys[p]] for p in own} & set(g.members):
            keep = np.array([p for p in own if owner[g.schema.keys[p]] == r], dtype=np.int32)
            out[r] = SavePlan([], planner_data=CompactFinal(keep.tobytes(), r, world, wide))
    return out, metadata


def _storage(props: Any, size: tuple[int, ...]) -> int:
    """torch's ``WriteItem.tensor_storage_size`` for a whole tensor."""
    return int(np.prod(size, dtype=np.int64)) * torch._utils._element_size(props.dtype)


def _keys_of(groups: list[_Group], rank: int) -> set[str]:
    """The keys of ``rank``'s items."""
    return next(set(g.schema.keys) for g in groups if rank in g.members)


def _check_chunks(
    groups: list[_Group], sig: dict[str, tuple[Any, ...]], widths: dict[str, int], world: int
) -> tuple[dict[str, int] | None, list[str]]:
    """Each tensor's chunk count, and the tensors whose chunks torch's own validation must check
    (they do not tile along dimension 0 in rank order); ``(None, [])`` when the save must be
    planned in full (volumes that do not add up: duplicated shards)."""
    counts: dict[str, int] = {}
    volume: dict[str, int] = {}
    extents: dict[str, list[tuple[int, int]]] = {}
    slow: set[str] = set()
    for key, (shard, kind, _, _) in sig.items():
        if kind != BYTES and not shard:
            counts[key] = 1  # a whole tensor, on its one owner
        elif key in widths:
            counts[key] = world  # one row per rank: valid by construction
    for g in groups:
        kinds, sizes = g.schema.kinds, g.schema.sizes
        cols = [p for p in range(len(kinds)) if kinds[p] == SHARD and g.schema.keys[p] not in widths]
        if not cols:
            continue
        D = g.dims
        glob = np.ones((len(cols), D), dtype=np.int64)
        ndim = np.zeros(len(cols), dtype=np.int64)
        for j, p in enumerate(cols):
            ndim[j] = len(sizes[p])
            glob[j, : ndim[j]] = sizes[p]
        pad = np.arange(D)[None, :] >= ndim[:, None]  # dims past a tensor's own
        vol = np.zeros(len(cols), dtype=np.int64)
        tiled = np.ones(len(cols), dtype=bool)
        first = last_end = None
        for b in range(0, len(g.members), _BLOCK):
            rows = g.at[cols]
            block = np.stack([g.table(m)[rows] for m in g.members[b : b + _BLOCK]])  # members x cols x 2D
            off, size = block[:, :, :D], block[:, :, D:]
            size1 = np.where(pad[None], 1, size)
            if ((off < 0) | (size < 0) | (off + size > np.where(pad, 0, glob)[None])).any():
                return None, []  # out of bounds: the full path raises torch's own error
            vol += np.prod(size1, axis=2).sum(axis=0)
            if D:
                rest = (off[:, :, 1:] == 0) & (size1[:, :, 1:] == glob[None, :, 1:])
                tiled &= rest.all(axis=(0, 2))
                start, end = off[:, :, 0], off[:, :, 0] + size[:, :, 0]
                tiled &= (start[1:] >= end[:-1]).all(axis=0)
                if last_end is not None:
                    tiled &= start[0] >= last_end
                if first is None:
                    first = start[0]
                last_end = end[-1]
            else:
                tiled[:] = False
        for j, p in enumerate(cols):
            key = g.schema.keys[p]
            counts[key] = counts.get(key, 0) + len(g.members)
            volume[key] = volume.get(key, 0) + int(vol[j])
            if not tiled[j]:
                slow.add(key)
            elif D:
                extents.setdefault(key, []).append((int(first[j]), int(last_end[j])))
    for key, spans in extents.items():
        spans.sort()
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            slow.add(key)  # blocks of ranks interleave: torch's sweep decides
    for key, v in volume.items():
        size = sig[key][3]
        numel = int(np.prod(size, dtype=np.int64))
        if (world > 1 and v != numel) or ((numel == 0 or not size) and counts[key] > 1):
            return None, []  # duplicated (HSDP) or missing chunks: torch's dedup and checks
    return counts, sorted(slow)


def _lister(key: str, groups: list[_Group], owner: dict[str, int], widths: dict[str, int], world: int) -> Any:
    """A function listing ``key``'s chunks in torch's order (:class:`LazyChunks`)."""

    def make() -> list[ChunkStorageMetadata]:
        if key in widths:
            w = widths[key]
            return [ChunkStorageMetadata(torch.Size((r, 0)), torch.Size((1, w))) for r in range(world)]
        found: list[tuple[int, int, ChunkStorageMetadata]] = []
        for g in groups:
            for p, k in enumerate(g.schema.keys):
                if k != key:
                    continue
                nd, D = len(g.schema.sizes[p]), g.dims
                if int(g.schema.kinds[p]) != SHARD:
                    m = owner[key]
                    if m not in g.members:
                        continue
                    members = [m]
                else:
                    members = g.members
                for m in members:
                    if int(g.schema.kinds[p]) != SHARD:  # a whole tensor (compact_local checked it)
                        size = g.schema.sizes[p]
                        chunk = ChunkStorageMetadata(torch.Size((0,) * nd), torch.Size(size))
                    else:
                        row = g.table(m)[g.at[p]].tolist()
                        chunk = ChunkStorageMetadata(torch.Size(row[:nd]), torch.Size(row[D : D + nd]))
                    found.append((m, p, chunk))
        found.sort(key=lambda t: (t[0], t[1]))
        return [c for _, _, c in found]

    return make


def _merged_mappings(plans: Sequence[CompactLocal]) -> dict[str, Any]:
    """``dict(ChainMap(*every rank's mappings))`` as torch merges them, each distinct mappings
    decoded once: the keys in the order of the last occurrence of each distinct mapping scanned
    backwards, the values from the first occurrence that holds the key."""
    firsts: dict[bytes, int] = {}
    lasts: dict[bytes, int] = {}
    for r, p in enumerate(plans):
        if p.mappings_digest is None:
            continue
        firsts.setdefault(p.mappings_digest, r)
        lasts[p.mappings_digest] = r
    decoded = {d: decode_mappings(plans[r].mappings, r) for d, r in firsts.items()}
    values = ChainMap(*(decoded[d] for d, _ in sorted(firsts.items(), key=lambda t: t[1])))
    order = ChainMap(*(decoded[d] for d, _ in sorted(lasts.items(), key=lambda t: t[1])))
    return {k: values[k] for k in order}
