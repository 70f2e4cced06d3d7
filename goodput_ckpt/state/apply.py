"""A restore's last steps, once DCP has filled a :class:`.bundle.RestorePlan`'s destination:
decode and check this rank's per-rank state, then load everything into the live objects, so that
nothing is loaded while a part may still fail to decode.

A restore loads the destination in two parts (:func:`split_dest`): first the per-rank rows (RNG,
dataloader: small, and everything in them that can refuse the restore), which
:func:`decode_restore` decodes and checks; only then the model, optimizer and other objects'
tensors, which ``dcp.load`` reads into the live parameters in place; then :func:`apply_restore`.
So a restore refused for its per-rank state leaves every live tensor as it was.

A schema-2 checkpoint's own rows (``rng.rows``, ``dataloader.rows``) are decoded in the rows
load's read phase already (``per_rank.rng_row``, ``per_rank.loader_row``): one rank's bad or
missing row fails that load on every rank there, instead of on that rank alone while the others
train on. What :func:`decode_restore` decodes then is only what is the same on every rank (an
elastic restore's old loader states, after the coordinator shared them) or schema 1's blobs.

Each section of the plan (``state.bundle.sections``) has its step here, in the same order:
models, other stateful objects, the dataloader or the elastic dataloader, then RNG (last, so that
nothing run while loading the others shifts it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .bundle import RestorePlan
from .bundle.meta import MODEL, OPTIMIZER
from .dataloader import AdoptsSavedEpoch, PreparesElasticResume, SplitsJobState, elastic_sampler_of
from .per_rank import DATALOADER, RNG, checked_rng, decode_own_loader_state, old_loader_states
from .rng import derive_rng, restore_rng

__all__ = ["DecodedState", "apply_restore", "decode_restore", "split_dest"]

logger = logging.getLogger("goodput_ckpt.state")


@dataclass
class DecodedState:
    """What a restore decodes from the filled destination before it changes anything: this
    rank's generators (checked), and its dataloader state or, elastic, the old ranks' states
    with the checked position that applies them."""

    rng: dict[str, torch.Tensor] | None = None
    loader_state: Any = None
    old_loader_states: list[Any] | None = None
    #: Elastic: applies the position the old loader states were checked into; returns its note.
    resume: Callable[[], str] | None = None


#: The sections of a destination that hold per-rank rows: loaded and checked first.
ROW_SECTIONS = (RNG, DATALOADER)


def split_dest(plan: RestorePlan) -> tuple[dict[str, Any], dict[str, Any]]:
    """``plan.dest`` in the two parts a restore loads one after the other: the per-rank rows
    (RNG, dataloader; either may be empty), then the rest (model, optimizer, other objects),
    whose tensors are the live ones. No section is in both (``bundle.RESERVED_NAMES``)."""
    rows = {k: v for k, v in plan.dest.items() if k in ROW_SECTIONS}
    return rows, {k: v for k, v in plan.dest.items() if k not in ROW_SECTIONS}


def _decode_elastic_loader(plan: RestorePlan, out: DecodedState) -> None:
    """Elastic: every old rank's state, joined to the job-level record where it was split from
    one, and checked into the position that applies them."""
    holder = elastic_sampler_of(plan.dataloader)
    assert holder is not None  # plan_restore planned an elastic loader only for a loader with one
    states = old_loader_states(plan.elastic_blobs)
    if isinstance(holder, SplitsJobState):
        where = f"{plan.where}: the dataloader row of old rank "
        states = [holder.join_job_state(st, plan.loader_job, where=f"{where}{r}") for r, st in enumerate(states)]
    out.old_loader_states = states
    if isinstance(holder, PreparesElasticResume):
        out.resume = holder.prepare_elastic_resume(states, batch_size=plan.saved_batch_size, where=plan.where)
    else:  # a holder of another kind: it checks when it applies
        out.resume = lambda: holder.elastic_resume(states, batch_size=plan.saved_batch_size, where=plan.where)


def decode_restore(plan: RestorePlan) -> DecodedState:
    """Decode and check this rank's per-rank state (its RNG row, its dataloader row; what the
    read phase decoded already is taken from there) without touching a live object. The loader's
    position holder (an ``ElasticSampler``, a ``TokenStream``) checks the saved position too,
    every count in range (this rank's own row in the read phase, so that a bad one fails every
    rank), so that a bad one is refused before :func:`apply_restore` loads anything.

    Raises:
        CorruptCheckpointError: the saved RNG state does not load, or a saved count or position
            is malformed or out of range.
        CheckpointError: a dataloader state does not decode (or this rank saved none).
    """
    out = DecodedState(rng=checked_rng(plan.dest[RNG], plan.rng_layout, plan.where) if plan.restore_rng else None)
    if plan.elastic_from:
        _decode_elastic_loader(plan, out)
    elif plan.dataloader is not None:  # checked too, in the read phase if DCP decoded the row there
        out.loader_state = decode_own_loader_state(plan.dest[DATALOADER], plan.loader_check)
    return out


def _apply_models(plan: RestorePlan) -> None:
    plan.models.load(plan.dest[MODEL], plan.dest.get(OPTIMIZER))


def _apply_stateful(plan: RestorePlan) -> None:
    for name, obj in plan.stateful.items():
        obj.load_state_dict(plan.dest[name])


def _apply_elastic_loader(plan: RestorePlan, decoded: DecodedState) -> None:
    assert decoded.resume is not None
    note = decoded.resume()
    plan.dataloader.load_state_dict({})  # a fresh iterator, which reads the sampler's position
    logger.info("%s: %s", plan.where, note)


def _apply_loader(plan: RestorePlan, decoded: DecodedState) -> None:
    state = decoded.loader_state
    plan.dataloader.load_state_dict(state)
    holder = elastic_sampler_of(plan.dataloader)
    if isinstance(holder, AdoptsSavedEpoch):
        holder.adopt_saved_epoch(state)


def _apply_rng(plan: RestorePlan, decoded: DecodedState) -> None:
    if decoded.rng is not None:
        plan.notes.extend(restore_rng(decoded.rng))
    elif plan.rederive_rng is not None:
        base, step, rank = plan.rederive_rng
        seed = derive_rng(base, step, rank)
        logger.warning(
            "%s: saved by another number of ranks, so this rank's RNG streams (Python, NumPy, torch, CUDA) "
            "were re-derived, not restored: seed %d from base seed %d, step %d, rank %d (see docs/manager.md)",
            plan.where,
            seed,
            base,
            step,
            rank,
        )


def apply_restore(plan: RestorePlan, decoded: DecodedState | None = None) -> None:
    """Load the filled destination into the live objects. RNG goes last, so that nothing that
    runs while loading (an optimizer's state initialization, a dataloader's reset) shifts it.

    ``decoded``: what :func:`decode_restore` made of the rows, before the rest was loaded (the
    manager's order, module doc); ``None`` decodes now. An elastic restore in a process group
    calls :func:`.loader_share.share_loader_states` before decoding: only then do the ranks
    other than the coordinator hold the old loader states.

    Raises:
        CorruptCheckpointError, CheckpointError: as :func:`decode_restore` (when ``decoded`` is
            ``None``), before anything is loaded into the live objects.
    """
    if decoded is None:
        decoded = decode_restore(plan)
    _apply_models(plan)
    _apply_stateful(plan)
    if plan.elastic_from:
        _apply_elastic_loader(plan, decoded)
    elif plan.dataloader is not None:
        _apply_loader(plan, decoded)
    _apply_rng(plan, decoded)
