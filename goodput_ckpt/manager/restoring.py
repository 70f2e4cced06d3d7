"""What a restore loads into and how: the one typed object a storage chain's restore is given.

A chain (:mod:`.chain`) knows where a step's files are and how its ranks pick a step they can
all read; a :class:`RestoreTarget` knows the rest, the same for every chain: the objects restored
into (model, optimizer, dataloader, other stateful objects), how to plan a checkpoint's load for
them, what every rank's plan must agree on, and how to load a plan in its two parts and apply it.
Every rank makes every call, in this order (``docs/architecture.md``, the restore flow)::

    plan = target.plan(manifest, where)        # may raise: the chain gathers every rank's outcome
    target.agreement(plan)                     # rides on that gather
    target.read(ROWS, plan, reader, ...)       # the per-rank rows (state.apply.split_dest)
    target.decode(plan)                        # decoded and checked on every rank, or refused on all
    target.read(TENSORS, plan, reader, ...)    # the tensors, into the live ones
    target.apply(restored)                     # load into the objects, record, report

The order is the point (issue 33): nothing live changes until every rank's per-rank state is
known good.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..dcp.collectives import Group
from ..dcp.load_planner import GridLoadPlanner
from ..dcp.read_sources import ReadSources
from ..dcp.reader import CheckpointReader
from ..errors import CheckpointError, as_checkpoint_error
from ..format.manifest import Manifest
from ..state import Topology, apply_restore, plan_restore
from ..state.apply import DecodedState, decode_restore, split_dest
from ..state.bundle import RestorePlan
from ..state.loader_share import share_key, share_loader_states
from ..state.per_rank import loader_states_read
from .agreement import deliberate_no_dist, raise_if_any_rank_failed
from .config import ManagerConfig
from .timeline import RestoreRecord, TimelineSink, tensor_nbytes

__all__ = ["ROWS_PART", "TENSORS_PART", "RestoreTarget", "Restored"]

logger = logging.getLogger("goodput_ckpt.manager")

#: The two parts of a plan's destination, loaded in this order (``state.apply.split_dest``).
ROWS_PART, TENSORS_PART = 0, 1


@dataclass
class Restored:
    """What a chain's restore chose and loaded: the step, where it was read (for messages and
    the job check), its commit record, this rank's loaded plan, and with two tiers where this
    rank's data files came from (tier -> files)."""

    step: int
    where: str
    manifest: Manifest
    plan: RestorePlan
    sources: dict[str, int] | None = None


@dataclass
class RestoreTarget:
    """One restore's objects and settings (module doc). Made by ``CheckpointManager.restore``.

    Args:
        models: the normalized models and optimizers (``state.normalize``).
        dataloader, stateful: as ``restore`` got them.
        topology, config, group, timeline: the manager's.
        storage_options: the persistent root's backend options (its readers').
    """

    models: Any
    dataloader: Any
    stateful: dict[str, Any]
    topology: Topology
    config: ManagerConfig
    group: Group
    timeline: TimelineSink
    started: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.perf_counter)
    #: part -> the reader of its last load (what the restore record counts).
    readers: dict[int, CheckpointReader] = field(default_factory=dict)
    decoded: DecodedState | None = None

    # -- planning ---------------------------------------------------------------------------
    def plan(self, manifest: Manifest, where: str) -> RestorePlan:
        """This rank's plan (``state.plan_restore``); raises ``CheckpointError`` (the chain
        gathers every rank's outcome before any load)."""
        return plan_restore(
            manifest,
            where=where,
            models=self.models,
            dataloader=self.dataloader,
            stateful=self.stateful,
            topology=self.topology,
            allow_topology_change=self.config.allow_topology_change,
        )

    @staticmethod
    def agreement(plan: RestorePlan | None) -> tuple[str, Any]:
        """What every rank's plan must agree on before the loads (``agreement``): whether, and
        how much, old loader state the coordinator broadcasts between them (``state.loader_share``)."""
        return "the old ranks' loader states of an elastic restore (count, bytes)", share_key(plan)

    @staticmethod
    def reads_rows(plan: RestorePlan | None) -> bool:
        """Whether this rank's plan reads per-rank rows (ranks may differ: the chain gathers it)."""
        return plan is not None and bool(split_dest(plan)[ROWS_PART])

    @staticmethod
    def dest(plan: RestorePlan) -> dict[str, Any]:
        """The whole destination of ``plan``: what the loads read (``dcp.needed_files``)."""
        return plan.dest

    # -- loading ----------------------------------------------------------------------------
    def reader(self, where: str, sources: ReadSources | None = None, **options: Any) -> CheckpointReader:
        """A reader of ``where`` with the manager's settings (``sources``: a chain's tier inputs)."""
        return CheckpointReader(
            where,
            verify=self.config.verify,
            thread_count=self.config.thread_count,
            process_group=self.group.pg,
            sources=sources,
            **options,
        )

    def read(self, part: int, plan: RestorePlan, reader: CheckpointReader, what: str, *, local: bool = False) -> None:
        """``dcp.load`` of part ``part`` of ``plan``'s destination through ``reader``: every rank
        together, over the manager's group.

        ``local``: each rank loads on its own, with none of ``dcp.load``'s collectives (the plan
        gather and scatter, which ``GridLoadPlanner`` leaves empty for a v2 checkpoint, and the
        read phase's gather), for a chain that gathers every rank's outcome itself right after
        (the two-tier restore). Then the rows part also decodes what this rank can decode alone
        (all but an elastic restore's shared states), so that its outcome rides on that gather,
        and a rank with nothing to read reads nothing.
        """
        if part == ROWS_PART:  # a new candidate step, or the rows again after a repair
            self.readers.clear()
            self.decoded = None
        dest = split_dest(plan)[part]
        if local and not dest:
            self.readers.pop(part, None)
        else:
            self.readers[part] = reader
            no_dist = deliberate_no_dist(self.group.single or local)
            try:
                dcp.load(
                    dest, storage_reader=reader, planner=GridLoadPlanner(), process_group=self.group.pg, no_dist=no_dist
                )
            except (Exception, CheckpointException) as e:
                raise as_checkpoint_error(e, what) from e
        if local and part == ROWS_PART and not plan.elastic_from:
            self.decoded = decode_restore(plan)

    def decode(self, plan: RestorePlan) -> None:
        """Every rank, once the rows are read on every rank and before any tensor is: share an
        elastic restore's old loader states, decode and check this rank's state, and raise on
        every rank when some rank's does not decode (then nothing live changed anywhere).
        Nothing to do (no collective) when a local rows load decoded already (:meth:`read`)."""
        if self.decoded is not None and not plan.elastic_from:
            return
        share_loader_states(plan, self.group)  # elastic: the coordinator's old loader states to all
        err = None
        try:
            self.decoded = decode_restore(plan)
        except CheckpointError as e:
            err = e
        raise_if_any_rank_failed(self.group, err)

    # -- applying ---------------------------------------------------------------------------
    def apply(self, restored: Restored) -> None:
        """Every rank, after both loads: load the plan into the objects, record the restore,
        report its notes."""
        plan = restored.plan
        assert self.decoded is not None, "decode() ran before the tensors were read"
        apply_restore(plan, self.decoded)
        loader_states = None
        if plan.dataloader is not None:
            readers = list(self.readers.values())
            loader_states = loader_states_read([r.rows_read for r in readers], [r.keys_read for r in readers])
        self.timeline.emit(
            RestoreRecord(
                step=restored.step,
                rank=self.topology.rank,
                world_size=self.topology.world_size,
                time=self.started,
                seconds=time.perf_counter() - self.t0,
                bytes=tensor_nbytes(plan.dest),
                sources=restored.sources,
                loader_states=loader_states,
            )
        )
        for note in plan.notes:  # one channel: the log (docs/manager.md, "What a restore reports")
            logger.warning("restore of step %d: %s", restored.step, note)
        logger.info("restored step %d from %s", restored.step, restored.where)
