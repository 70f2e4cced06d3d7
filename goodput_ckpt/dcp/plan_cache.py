"""Save-plan caching for :class:`~.save_planner.ReplicaGroupingSavePlanner`: from the second save
of a run with the same layout on, each rank sends the coordinator a digest instead of its plan,
and the coordinator scatters an empty plan instead of the final one.

Why: ``dcp.save`` gathers every rank's local plan on the coordinator (O(ranks x tensors) bytes
to unpickle), runs ``create_global_plan`` over them and scatters the final plans back: at
thousands of ranks the coordinator's largest cost, and the same every save of a run
(docs/scale.md). torch's own ``enable_plan_caching`` cannot serve ``CheckpointWriter``: it hands a
rank whose plan did not change the previous save's final plan with that save's storage data,
the writer's file names, and a write under those names would overwrite the committed
checkpoint. Here the empty plan a rank gets carries this save's storage data (fresh names), and
the rank's cached final plan takes it.

Consistency between ranks: a rank sends a digest only for the plan it cached at its last
*successful* plan exchange (cached in ``finish_plan``, which every rank reaches only when the
coordinator's global step succeeded, and dropped at the start of each save until then), and the
coordinator checks each digest against the plan it holds for that rank. A rank or coordinator
whose cache is out of step fails that save with :class:`~goodput_ckpt.CheckpointError` and
drops its cache, so the next save exchanges full plans again.

Memory on the coordinator: the cache keeps every rank's local plan, because a save where only
some ranks' plans changed (a widened row grew on one rank) is planned again from every rank's
plan, the unchanged ones' taken from here. They are compact plans (:mod:`.compact_plan`), and
the schema and mappings blobs, the same on nearly every rank, are kept once per digest
(:func:`_interned`): what stays per rank is its compressed box table and a few references
(about 3 KB a rank for a 70B state, against 135 KB before, docs/scale.md).

One :class:`SavePlanCache` per sequence of saves by the same ranks (a ``CheckpointManager``
keeps one); a planner without one plans every save in full.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import threading
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from ..errors import CheckpointError
from .compact_plan import CompactLocal

__all__ = ["PlanDigest", "SavePlanCache", "plan_digest"]


@dataclass(frozen=True)
class PlanDigest:
    """The digest of a rank's local plan, in the ``storage_data`` of the plan it sends: with the
    plan itself, or in place of it (an empty ``usable=False`` plan) when the coordinator holds it."""

    digest: bytes


def plan_digest(plan: SavePlan) -> bytes:
    """A digest of what the coordinator reads from a local plan: its items and planner data.
    O(items) on the rank; pickling the same objects in one process gives the same bytes."""
    blob = pickle.dumps((plan.items, plan.planner_data), protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.blake2b(blob, digest_size=16).digest()


class SavePlanCache:
    """The plans of the last successful save exchange, on each rank (its local and final plan)
    and on the coordinator (every rank's local plan, the final plans and the ``Metadata``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Rank side: (digest of the local plan sent, the final plan), set by finish_plan.
        self._local: tuple[bytes, SavePlan] | None = None
        self._pending_local: bytes | None = None
        # Coordinator side: (digests, local plans, final plans, metadata), set by finish_plan.
        self._global: tuple[list[bytes], list[SavePlan], list[SavePlan], Metadata] | None = None
        self._pending_global: tuple[list[bytes], list[SavePlan], list[SavePlan], Metadata] | None = None
        self._unchanged_final: SavePlan | None = None  # this save's final plan when it sent a digest
        self.reused_local = 0  # saves whose local plan went as a digest (tests, benchmarks)
        self.reused_global = 0  # saves whose global step took the cached final plans

    # -- every rank ------------------------------------------------------------------------------
    def local_plan_to_send(self, plan: SavePlan) -> SavePlan:
        """``plan``, or an empty plan carrying its digest when it equals the cached one. The
        cache is dropped until this save's ``finish_plan`` (a failed save leaves none)."""
        digest = plan_digest(plan)
        with self._lock:
            cached, self._local = self._local, None
            self._pending_local = digest
        if cached is not None and cached[0] == digest:
            self._unchanged_final = cached[1]
            self.reused_local += 1
            return SavePlan([], usable=False, storage_data=PlanDigest(digest))
        self._unchanged_final = None
        return dataclasses.replace(plan, storage_data=PlanDigest(digest))  # the coordinator need not hash it

    def final_plan(self, new_plan: SavePlan) -> SavePlan:
        """The plan this rank writes: ``new_plan``, or for an empty one the cached final plan
        with ``new_plan``'s storage data (this save's file names). Caches it."""
        if not new_plan.usable:
            final = self._unchanged_final
            if final is None:
                raise CheckpointError("the coordinator sent an empty save plan to a rank without a cached plan")
            new_plan = dataclasses.replace(final, storage_data=new_plan.storage_data)
        with self._lock:
            if self._pending_local is not None:
                self._local = (self._pending_local, dataclasses.replace(new_plan, storage_data=None))
            self._pending_local = None
            self._unchanged_final = None
            if self._pending_global is not None:
                self._global, self._pending_global = self._pending_global, None
        return new_plan

    # -- the coordinator ---------------------------------------------------------------------------
    def global_plan(self, all_plans: list[SavePlan], plan_all: Any) -> tuple[list[SavePlan], Metadata]:
        """The plans to scatter and the ``Metadata``: ``plan_all(local_plans)`` (the planner's
        full global step) unless every rank sent its digest, then the cached ones, each rank's
        plan an empty one. A rank that sent a digest has its cached local plan put back."""
        with self._lock:
            cached, self._global = self._global, None
        digests: list[bytes] = []
        local: list[SavePlan] = []
        for rank, plan in enumerate(all_plans):
            if plan.usable:
                sent = plan.storage_data
                digests.append(sent.digest if isinstance(sent, PlanDigest) else plan_digest(plan))
                local.append(plan)
                continue
            sent = plan.storage_data
            if not isinstance(sent, PlanDigest):
                raise CheckpointError(f"rank {rank} sent an empty save plan without a digest (torch's plan caching?)")
            if cached is None or len(cached[0]) != len(all_plans) or cached[0][rank] != sent.digest:
                raise CheckpointError(
                    f"rank {rank} sent the digest of a save plan the coordinator does not hold (its cache is out "
                    "of step); this save fails and the next one exchanges full plans"
                )
            digests.append(sent.digest)
            local.append(cached[1][rank])
        if cached is not None and all(not p.usable for p in all_plans):
            final, metadata = cached[2], cached[3]
            self.reused_global += 1
            scatter = [SavePlan([], usable=False) for _ in all_plans]
        else:
            final, metadata = plan_all(local)
            scatter = [
                p if all_plans[r].usable or cached is None else _delta(cached[2][r], p) for r, p in enumerate(final)
            ]
        with self._lock:
            self._pending_global = (digests, _interned(local), final, metadata)
        return scatter, metadata


def _interned(plans: list[SavePlan]) -> list[SavePlan]:
    """``plans`` with the schema and mappings blobs of compact plans shared between the ranks
    that sent the same digest (and length): one copy per distinct blob, not one per rank. The
    digests are what the global step already groups ranks by (:mod:`.compact_global`)."""
    seen: dict[bytes, bytes] = {}

    def one(digest: bytes | None, blob: bytes | None) -> bytes | None:
        if digest is None or blob is None:
            return blob
        kept = seen.setdefault(digest, blob)
        return kept if len(kept) == len(blob) else blob

    out = []
    for plan in plans:
        data = plan.planner_data
        if isinstance(data, CompactLocal):
            schema, mappings = one(data.schema_digest, data.schema), one(data.mappings_digest, data.mappings)
            if schema is not data.schema or mappings is not data.mappings:
                plan = dataclasses.replace(
                    plan, planner_data=dataclasses.replace(data, schema=schema, mappings=mappings)
                )
        out.append(plan)
    return out


def _delta(cached_final: SavePlan, final: SavePlan) -> SavePlan:
    """What a rank that sent a digest gets: an empty plan when its final plan did not change,
    else the new one (another rank's change can move replicated values between ranks)."""
    same = cached_final.items == final.items and cached_final.planner_data == final.planner_data
    return SavePlan([], usable=False) if same else final
