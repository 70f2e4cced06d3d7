"""A restore plan's sections, in the order :func:`.plan.plan_restore` runs them: models (with
their optimizers), other stateful objects, RNG, the dataloader, and the elastic dataloader. Each
section has a check of what the checkpoint holds against what the caller restores into (run
before anything is built, so that a refusal builds nothing), and a plan step that adds its part
of DCP's destination to the plan. Which of the per-rank sections (RNG, dataloader) a restore
takes, and whether the loader is elastic, is :mod:`.policy`'s decision. The apply step of each
section is in :mod:`goodput_ckpt.state.apply`, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ...errors import CheckpointError
from ...format.manifest import Manifest
from ..dataloader import JOB_POSITION, ChecksSavedState, SplitsJobState, check_dataloader, elastic_sampler_of
from ..modules import ModelSet
from ..optim_state import saved_states
from ..per_rank import (
    DATALOADER,
    RNG,
    ROWS,
    blob_template,
    loader_row,
    rank_key,
    rng_layout_of,
    rng_row,
    rng_templates,
    rows_width,
)
from ..rng import row_width
from .meta import META_KEY, MODEL, OPTIMIZER, Topology

if TYPE_CHECKING:
    from .plan import RestorePlan

__all__ = [
    "check_models",
    "check_stateful_saved",
    "loader_to_restore",
    "plan_elastic_loader",
    "plan_loader",
    "plan_models",
    "plan_rng",
    "plan_stateful",
]


# -- models and their optimizers -------------------------------------------------------------
def check_models(meta: dict[str, Any], models: ModelSet, where: str) -> None:
    """The checkpoint holds the models (one, or the same names) and every optimizer asked for.

    Raises:
        CheckpointError: it does not.
    """
    sections = set(meta["sections"])
    saved_named = meta.get("models") is not None
    if saved_named != models.named or (models.named and sorted(models.pairs) != meta["models"]):
        raise CheckpointError(
            f"{where} holds {'models ' + str(meta['models']) if saved_named else 'a single model'} but "
            f"restore got {'models ' + str(sorted(models.pairs)) if models.named else 'a single model'}",
            path=where,
        )
    if models.has_optimizer and OPTIMIZER not in sections:
        raise CheckpointError(f"{where} holds no optimizer state; call restore without optimizer=", path=where)
    if models.named and models.has_optimizer:
        missing = sorted(n for n, (_, o) in models.pairs.items() if o and n not in (meta.get("optimizers") or []))
        if missing:
            raise CheckpointError(f"{where} holds no optimizer state for models {missing}", path=where)


def plan_models(plan: RestorePlan, manifest: Manifest) -> None:
    """The models' (and optimizers') state dicts as DCP's destination; a fresh optimizer's state
    is shaped from the checkpoint (:mod:`..optim_state`)."""
    models = plan.models

    def saved(name: str) -> dict[str, Any]:
        return saved_states(manifest, f"{OPTIMIZER}.{name}.state." if models.named else f"{OPTIMIZER}.state.")

    msd, osd = models.state_dicts(saved)  # called only for models with optimizers
    plan.dest[MODEL] = msd
    if models.has_optimizer:
        plan.dest[OPTIMIZER] = osd


# -- other stateful objects (scheduler=, scaler=, ...) ---------------------------------------
def check_stateful_saved(meta: dict[str, Any], stateful: Mapping[str, Any], where: str) -> None:
    """The checkpoint holds a section for every keyword object.

    Raises:
        CheckpointError: it does not (the message lists what it holds).
    """
    sections = set(meta["sections"])
    missing = sorted(n for n in stateful if n not in sections)
    if missing:
        raise CheckpointError(
            f"{where} holds no state for {', '.join(f'{n}=' for n in missing)} (it holds "
            f"{', '.join(sorted(sections - {MODEL, OPTIMIZER, RNG, DATALOADER})) or 'no other objects'})",
            path=where,
        )


def plan_stateful(plan: RestorePlan, stateful: Mapping[str, Any]) -> None:
    """Each object's current state dict as its destination (DCP loads the keys it has)."""
    for name, obj in stateful.items():
        plan.dest[name] = obj.state_dict()
        plan.stateful[name] = obj


# -- RNG (per rank) --------------------------------------------------------------------------
def plan_rng(plan: RestorePlan, manifest: Manifest, meta: dict[str, Any], topology: Topology) -> None:
    """This rank's generators: schema 1's rank-unique keys, or its row of ``rng.rows`` (decoded
    and checked in DCP's read phase).

    Raises:
        CorruptCheckpointError: the RNG layout or the rows' shape is not what the metadata says.
    """
    where = plan.where
    if meta["schema"] == 1:
        plan.dest[RNG] = {rank_key(topology.rank): rng_templates(manifest, topology.rank, where)}
    else:
        ws = topology.world_size
        plan.rng_layout = rng_layout_of(meta, META_KEY, where)
        width = rows_width(manifest, RNG, ws, row_width(plan.rng_layout), where)
        plan.dest[RNG] = {ROWS: rng_row(width, topology.rank, ws, plan.rng_layout, where)}
    plan.restore_rng = True


# -- the dataloader (same topology) ----------------------------------------------------------
def loader_to_restore(plan: RestorePlan, meta: dict[str, Any], dataloader: Any) -> Any:
    """The dataloader whose state this restore can bring back, or ``None``; says in the plan's
    notes why a loader, or the saved loader state, is left as it is.

    Raises:
        TypeError: ``dataloader`` has no ``state_dict()`` and ``load_state_dict()``.
    """
    if dataloader is not None:
        check_dataloader(dataloader)
        if meta.get("dataloader") is None:
            plan.notes.append(
                f"{plan.where} holds no dataloader state (saved without one, or resharded with --rank-state "
                "drop); the dataloader starts from its beginning"
            )
            return None
    elif meta.get("dataloader") is not None:
        plan.notes.append("the checkpoint holds dataloader state but restore got no dataloader=; it was not restored")
    return dataloader


def _position_check(plan: RestorePlan, dataloader: Any, rank: int) -> Callable[[Any], Any] | None:
    """What makes ``rank``'s decoded loader state the one to apply: joined to the job-level
    record (``plan.loader_job``) and checked by the loader's position holder (``ElasticSampler``,
    ``TokenStream``), each when the holder can; ``None`` when it can neither. Reads
    ``plan.loader_job`` and ``plan.saved_batch_size`` when it runs."""
    holder = elastic_sampler_of(dataloader)
    join = holder.join_job_state if isinstance(holder, SplitsJobState) else None
    check = holder.check_saved_state if isinstance(holder, ChecksSavedState) else None
    if join is None and check is None:
        return None
    where = f"{plan.where}: the dataloader row of rank {rank}"

    def prepare(state: Any) -> Any:
        if join is not None:
            state = join(state, plan.loader_job, where=where)
        if check is not None:
            check(state, batch_size=plan.saved_batch_size, where=where)
        return state

    return prepare


def plan_loader(
    plan: RestorePlan, manifest: Manifest, meta: dict[str, Any], dataloader: Any, topology: Topology
) -> None:
    """This rank's own loader state: schema 1's rank-unique blob, or its row of
    ``dataloader.rows``, decoded and checked by the loader's position holder in DCP's read phase.

    Raises:
        CorruptCheckpointError: the rows' shape is not what the metadata says.
    """
    where = plan.where
    plan.saved_batch_size = meta["dataloader"].get("batch_size")
    plan.loader_job = meta["dataloader"].get(JOB_POSITION)
    plan.loader_check = _position_check(plan, dataloader, topology.rank)
    if meta["schema"] == 1:
        rk = rank_key(topology.rank)
        plan.dest[DATALOADER] = {rk: blob_template(manifest, f"{DATALOADER}.{rk}", where)}
    else:
        ws = topology.world_size
        width = rows_width(manifest, DATALOADER, ws, None, where)
        plan.dest[DATALOADER] = {ROWS: loader_row(width, topology.rank, ws, plan.loader_check)}
    plan.dataloader = dataloader


# -- the elastic dataloader (every old rank's state, any topology) ---------------------------
def plan_elastic_loader(
    plan: RestorePlan, manifest: Manifest, meta: dict[str, Any], dataloader: Any, topology: Topology
) -> None:
    """Every old rank's loader state (``plan.elastic_from`` of them, set by :mod:`.policy`): the
    coordinator reads them (they go in ``dest``), the others get empty blobs of the same sizes
    that :func:`..loader_share.share_loader_states` fills from its copy.

    Raises:
        CorruptCheckpointError: a blob's or the rows' shape is not what the metadata says.
    """
    where = plan.where
    if meta["schema"] == 1:
        keys = [rank_key(r) for r in range(plan.elastic_from)]
        plan.elastic_blobs = {k: blob_template(manifest, f"{DATALOADER}.{k}", where) for k in keys}
    else:  # every old rank's row: the whole tensor
        width = rows_width(manifest, DATALOADER, plan.elastic_from, None, where)
        plan.elastic_blobs = {ROWS: torch.empty((plan.elastic_from, width), dtype=torch.uint8)}
    plan.elastic_reads = topology.rank == 0
    if plan.elastic_reads:  # the others receive the blobs from the coordinator
        plan.dest[DATALOADER] = plan.elastic_blobs
    plan.dataloader = dataloader
    plan.saved_batch_size = meta["dataloader"].get("batch_size")
    plan.loader_job = meta["dataloader"].get(JOB_POSITION)
