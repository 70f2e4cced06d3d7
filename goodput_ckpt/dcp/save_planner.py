"""A DCP save planner that stores small replicated values once, on the lowest rank holding them.

Why: DCP assumes a plain tensor or object under the same key on several ranks is one replicated
value and keeps one copy (``dedup_save_plans``). By default it gives each copy to the rank with
the fewest bytes so far, which spreads hundreds of tiny values (AdamW's per-parameter ``step``,
``param_groups`` entries) over every rank's file. Every rank needs all of them at restore, so
each rank then reads from up to W files: W x W requests per restore on an object store
(measured in ``tests/storage/test_s3_requests.py``). Kept on the lowest rank they cost every rank
a read or two of one file. Large replicated tensors (a DDP model) keep torch's balancing, so
no rank writes much more than the others.

:class:`ReplicaGroupingSavePlanner` runs this before torch's own dedup (which then finds those
values already unique). Values held by one rank only (per-rank RNG and dataloader state) and
DTensor shards are never touched.

The plans the ranks exchange are compact (:mod:`.compact_plan`, :mod:`.compact_global`): a
schema per group of ranks and a box table per rank instead of torch's ``WriteItem`` lists, and a
global step that decides what the full path below decides without building those lists on the
coordinator. What the compact step does not decide itself is planned in full, as before.

It also resolves the per-rank rows of :mod:`.rank_rows` (which DCP's own lookup cannot), widens
the rows that may differ in length to the longest, and refuses a save whose ranks disagree on
the shape of the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ..errors import CheckpointError
from .compact_global import compact_global_plan
from .compact_plan import CompactFinal, CompactLocal, compact_local, expand, final_items
from .plan_cache import SavePlanCache
from .rank_rows import check_rank_rows, resolve_rank_row, row_widths, widen_rank_rows

__all__ = ["SMALL_REPLICA_BYTES", "ReplicaGroupingSavePlanner", "drop_empty_shards", "group_small_replicas"]

#: Replicated plain tensors below this many bytes go to the lowest rank; larger ones are
#: balanced by torch. 1 MiB: far above a scalar or a norm's state, far below a weight matrix.
SMALL_REPLICA_BYTES = 1 << 20


def _small(item: WriteItem) -> bool:
    if item.type == WriteItemType.BYTE_IO:
        return True
    if item.type == WriteItemType.TENSOR:
        size = item.tensor_storage_size()
        return size is not None and size < SMALL_REPLICA_BYTES
    return False  # a shard of a DTensor or ShardedTensor: one rank's own piece


def group_small_replicas(all_plans: list[SavePlan]) -> list[SavePlan]:
    """``all_plans`` with each small value that several ranks hold left only in the lowest of
    those ranks' plans. One pass over the items, which hashes only the small values' indices
    (a shard's index is never hashed: at W ranks x thousands of tensors that hashing was most
    of this function's time); plans without such values are returned as is."""
    first: dict[MetadataIndex, int] = {}
    drop: dict[int, list[int]] = {}  # rank -> positions of the copies another, lower rank keeps
    for rank, plan in enumerate(all_plans):
        for pos, item in enumerate(plan.items):
            if item.type != WriteItemType.SHARD and _small(item):
                if first.setdefault(item.index, rank) != rank:
                    drop.setdefault(rank, []).append(pos)
    if not drop:
        return all_plans
    out = list(all_plans)
    for rank, positions in drop.items():
        gone = set(positions)
        plan = all_plans[rank]
        out[rank] = dataclasses.replace(plan, items=[it for p, it in enumerate(plan.items) if p not in gone])
    return out


def _empty_shard(item: WriteItem) -> bool:
    data = item.tensor_data
    return item.type == WriteItemType.SHARD and data is not None and 0 in data.chunk.sizes and 0 not in data.size


def drop_empty_shards(all_plans: list[SavePlan]) -> list[SavePlan]:
    """``all_plans`` without the empty shards of non-empty tensors.

    Why: FSDP2 gives every rank past a tensor's end an empty shard, all under one index
    (offset = the tensor's length), and torch's dedup then hands each such index to one rank
    chosen by its bytes so far: the ranks' key lists all differ, which splits the commit
    record's rank groups (:mod:`.item_entries`) and makes its build O(ranks x tensors) in
    Python. An empty shard holds no byte and the record never lists it, so it is dropped
    here, before dedup. A tensor with no element keeps its shards (its only record)."""
    if not any(_empty_shard(it) for plan in all_plans for it in plan.items):
        return all_plans
    return [dataclasses.replace(plan, items=[it for it in plan.items if not _empty_shard(it)]) for plan in all_plans]


class ReplicaGroupingSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that keeps small replicated values on the lowest rank, and writes
    :class:`~.rank_rows.RankRow` values (module doc)."""

    def __init__(
        self,
        *args: Any,
        widen_rows: Collection[str] = (),
        plan_cache: SavePlanCache | None = None,
        compact: bool = True,
        **kwargs: Any,
    ) -> None:
        """``widen_rows``: the keys of :class:`~.rank_rows.RankRow` values made with
        ``widen=True`` (the same on every rank). ``plan_cache``: one per sequence of saves by
        the same ranks (:mod:`.plan_cache`): from the second save with the same layout on, the
        ranks exchange digests and empty plans instead of their plans. ``compact``: exchange
        compact plans (module doc; the same on every rank); ``False`` sends torch's ``WriteItem``
        lists (comparisons, benchmarks)."""
        super().__init__(*args, **kwargs)
        self._widen = frozenset(widen_rows)
        self._widths: dict[str, tuple[int, Any]] = {}
        self._cache = plan_cache
        self._compact = compact
        self._items: list[WriteItem] | None = None  # this rank's items, when it sent them compactly

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self._items = None
        if self._compact and plan.usable:
            items = [it for it in plan.items if not _empty_shard(it)]  # as drop_empty_shards, on the rank
            sent = compact_local(items, plan.planner_data, self._widen)
            if sent is not None:
                self._items, plan = items, SavePlan([], planner_data=sent)
        return plan if self._cache is None else self._cache.local_plan_to_send(plan)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self._cache is None:
            return self._plan_all(all_plans)
        scatter, self.metadata = self._cache.global_plan(all_plans, self._plan_all)
        return scatter, self.metadata

    def _plan_all(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        compact = [isinstance(p.planner_data, CompactLocal) and not p.items for p in all_plans]
        if all_plans and all(compact):
            done = compact_global_plan(all_plans, self._widen, SMALL_REPLICA_BYTES, self.flatten_state_dict)
            if done is not None:
                self.global_plan, self.metadata = done
                return done
        if any(compact):  # what the compact step does not decide: the full path, on torch's items
            all_plans = [_expanded(p, r) if c else p for r, (p, c) in enumerate(zip(all_plans, compact))]
        return self._plan_full(all_plans)

    def _plan_full(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self._widen:  # a pass over every rank's items, for nothing when no row may widen
            all_plans = widen_rank_rows(all_plans, self._widen)
        check_rank_rows(all_plans)
        return super().create_global_plan(group_small_replicas(drop_empty_shards(all_plans)))

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if self._cache is not None:
            new_plan = self._cache.final_plan(new_plan)
        if isinstance(new_plan.planner_data, CompactFinal):
            if self._items is None:
                raise CheckpointError("the coordinator sent a compact final plan to a rank that sent its plan in full")
            mappings = self.mappings if self.flatten_state_dict else None
            new_plan = dataclasses.replace(
                new_plan, items=final_items(self._items, new_plan.planner_data), planner_data=mappings
            )
        self._widths = row_widths(new_plan, self._widen)
        return super().finish_plan(new_plan)

    def lookup_object(self, index: MetadataIndex) -> Any:
        row = resolve_rank_row(self.state_dict, index, self._widths)
        return row if row is not None else super().lookup_object(index)


def _expanded(plan: SavePlan, rank: int) -> SavePlan:
    """A compact local plan as the ``WriteItem`` list and mappings it stands for."""
    items, mappings = expand(plan.planner_data, rank)
    return dataclasses.replace(plan, items=items, planner_data=mappings)
