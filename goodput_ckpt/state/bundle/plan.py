"""A restore's plan: what DCP loads into (``dest``) and what :func:`..apply.apply_restore` then
does with it, built section by section (:mod:`.sections`) after the per-rank policy
(:mod:`.policy`) decided which per-rank state comes back."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...format.manifest import Manifest
from ..modules import ModelSet
from .meta import Topology, check_stateful, training_meta
from .policy import per_rank_policy
from .sections import (
    check_models,
    check_stateful_saved,
    loader_to_restore,
    plan_elastic_loader,
    plan_loader,
    plan_models,
    plan_rng,
    plan_stateful,
)

__all__ = ["RestorePlan", "plan_restore"]


@dataclass
class RestorePlan:
    """What :func:`..apply.apply_restore` does once DCP filled ``dest``."""

    dest: dict[str, Any]
    models: ModelSet
    dataloader: Any = None
    stateful: dict[str, Any] = field(default_factory=dict)
    restore_rng: bool = False
    notes: list[str] = field(default_factory=list)
    #: Elastic data position: old ranks whose loader states go to the ElasticSampler (their
    #: count), the batch size they used, and where (for messages). 0 = not elastic.
    elastic_from: int = 0
    #: Elastic: the old ranks' loader blobs, rank order, filled before :func:`..apply.apply_restore`
    #: (schema 2: one entry, ``rows``, the whole tensor: a row per old rank).
    #: On the coordinator these are ``dest``'s own tensors (DCP reads them); elsewhere empty
    #: tensors of the sizes the manifest gives, which :func:`..loader_share.share_loader_states`
    #: fills from the coordinator's copy.
    elastic_blobs: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Whether DCP reads ``elastic_blobs`` into this rank (the coordinator) or it receives them.
    elastic_reads: bool = False
    #: The batch size the saved loader recorded (metadata, unchecked: the position holder checks
    #: it before it multiplies anything by it).
    saved_batch_size: Any = None
    #: The job-level part of the loader states (``dataloader.job_position`` in the metadata,
    #: unchecked: the position holder's ``join_job_state`` checks it), or ``None``.
    loader_job: Any = None
    #: Same topology: joins this rank's decoded loader state to ``loader_job`` and checks it
    #: (its position holder's ``join_job_state`` and ``check_saved_state``) before anything is
    #: applied, returning the state to apply; schema 2 runs it in DCP's read phase already.
    loader_check: Callable[[Any], Any] | None = None
    where: str = ""
    #: Topology change: (base seed, step, new rank) this rank's generators are re-derived from.
    rederive_rng: tuple[int, int, int] | None = None
    #: Schema 2: the slots of the RNG row this rank restores (``state.rng``).
    rng_layout: list[tuple[str, str, int]] | None = None


def plan_restore(
    manifest: Manifest,
    *,
    where: str,
    models: ModelSet,
    dataloader: Any,
    stateful: Mapping[str, Any],
    topology: Topology,
    allow_topology_change: bool,
) -> RestorePlan:
    """Check the checkpoint against what the caller restores into, and build DCP's destination.

    Policy for per-rank state (RNG, dataloader) when the world size, or the dataloader's worker
    count or batch size, changed: refuse with :class:`TopologyChangeError`; with
    ``allow_topology_change`` skip it (every rank keeps its current RNG and dataloader position)
    and report what was skipped in ``notes``. Model, optimizer and other objects reshard.

    Elastic loaders (an ``ElasticSampler`` saved and restored into, see ``state.dataloader``) need
    no flag: every rank gets all old ranks' loader states (only the coordinator,
    ``topology.rank == 0``, puts them in ``dest``; the others get them from it through
    :func:`..loader_share.share_loader_states`) and the sampler splits the epoch's
    pending samples among the new ranks; under another world size every rank's RNG is re-derived
    from the saved base seed, the step and its new rank (``state.rng``). A checkpoint without
    dataloader state (``reshard --rank-state drop``) restores with the loader left at its start.

    A fresh optimizer gets state shaped from the checkpoint, uninitialized until the load fills
    it (:mod:`..optim_state`): a caller whose load or apply fails calls
    ``models.discard_shaped_state()``, as ``CheckpointManager.restore`` does.

    Raises:
        TopologyChangeError: see above.
        CheckpointError: the caller asks for a section the checkpoint does not hold.
    """
    check_stateful(stateful)
    meta = training_meta(manifest, where)
    plan = RestorePlan(dest={}, models=models, where=where)
    # Every check first, so that a refusal builds nothing; then the destination, section by section.
    check_models(meta, models, where)
    check_stateful_saved(meta, stateful, where)
    dataloader = loader_to_restore(plan, meta, dataloader)
    per_rank = per_rank_policy(plan, meta, dataloader, topology, allow_topology_change)
    plan_models(plan, manifest)
    if per_rank.rng:
        plan_rng(plan, manifest, meta, topology)
    if plan.elastic_from:
        plan_elastic_loader(plan, manifest, meta, dataloader, topology)
    elif per_rank.loader:
        plan_loader(plan, manifest, meta, dataloader, topology)
    plan_stateful(plan, stateful)
    return plan
