"""Which per-rank sections (RNG, dataloader) a restore brings back, and how.

Per-rank state is saved for the topology that saved it: one RNG row and one loader row per
rank, a loader position that depends on its worker count and batch size. When the world size,
the worker count or the batch size changed, this module decides, in this order:

1. An elastic loader (its position holder is an ``ElasticSampler`` or a ``TokenStream``, and it
   was saved elastic) takes every old rank's state (``plan.elastic_from``); under another world
   size every rank's RNG is re-derived from the saved base seed, the step and its new rank
   (``plan.rederive_rng``) instead of restored.
2. Otherwise per-rank state cannot be mapped onto the new ranks: refuse with
   :class:`TopologyChangeError`, or with ``allow_topology_change`` skip it (each rank keeps its
   current RNG and loader position) and say so in the plan's notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import CorruptCheckpointError, TopologyChangeError
from ...format.schema import MAX_WORLD_SIZE
from ..dataloader import describe_dataloader, elastic_sampler_of
from ..per_rank import DATALOADER, RNG
from .meta import Topology

if TYPE_CHECKING:
    from .plan import RestorePlan

__all__ = ["PerRank", "per_rank_policy"]


@dataclass(frozen=True)
class PerRank:
    """The per-rank sections a restore plans from this rank's own saved state (an elastic
    loader's sections are planned from ``plan.elastic_from`` instead)."""

    rng: bool
    loader: bool


def _saved_loader_ranks(meta: dict[str, Any], want_dl: bool, where: str) -> int:
    """How many ranks' loader states there are: the saving world size, unless ``reshard``
    carried elastic positions over to another world size (it records the old one as "ranks").

    Raises:
        CorruptCheckpointError: not an integer in [1, MAX_WORLD_SIZE] (each costs a blob template).
    """
    dl_ranks = meta["dataloader"].get("ranks", meta["world_size"]) if want_dl else meta["world_size"]
    if isinstance(dl_ranks, bool) or not isinstance(dl_ranks, int) or not 1 <= dl_ranks <= MAX_WORLD_SIZE:
        raise CorruptCheckpointError(
            f"{where}: dataloader ranks must be an integer in [1, {MAX_WORLD_SIZE}]", path=where, key=DATALOADER
        )
    return dl_ranks


def _loader_settings_allow(
    plan: RestorePlan, meta: dict[str, Any], dataloader: Any, elastic: bool, dl_ranks: int, allow: bool
) -> bool:
    """Whether this rank still restores its own loader state once the worker count and batch
    size are compared with the saved ones: an elastic loader goes elastic, another is refused
    or (``allow``) skipped.

    Raises:
        TopologyChangeError: a non-elastic loader's settings changed, without ``allow``.
    """
    saved_dl, now_dl = meta["dataloader"], describe_dataloader(dataloader)
    diffs = [
        f"{k} {saved_dl.get(k)} -> {now_dl[k]}"
        for k in ("num_workers", "batch_size")
        if saved_dl.get(k) is not None and now_dl[k] is not None and saved_dl.get(k) != now_dl[k]
    ]
    if elastic and diffs:
        plan.elastic_from = dl_ranks
    elif diffs:
        msg = f"the dataloader differs from the one saved in {plan.where} ({', '.join(diffs)}): its position cannot be restored"
        if not allow:
            raise TopologyChangeError(
                f"{msg}. Use the saved settings, or pass CheckpointManager(..., "
                "allow_topology_change=True) to start this dataloader from its current state.",
                path=plan.where,
                key=DATALOADER,
            )
        plan.notes.append(f"{msg}; skipped (allow_topology_change=True)")
        return False
    return True


def per_rank_policy(
    plan: RestorePlan, meta: dict[str, Any], dataloader: Any, topology: Topology, allow_topology_change: bool
) -> PerRank:
    """Decide the per-rank sections (module docstring): sets ``plan.elastic_from`` and
    ``plan.rederive_rng``, adds a note for what is skipped, and returns what this rank restores
    from its own row. ``dataloader`` is the one :func:`.sections.loader_to_restore` kept.

    Raises:
        TopologyChangeError: per-rank state that cannot follow the new topology, without
            ``allow_topology_change``.
        CorruptCheckpointError: the saved count of loader ranks is out of range.
    """
    where, saved_ws = plan.where, meta["world_size"]
    want_rng = meta.get("rng") is not None
    want_dl = dataloader is not None
    per_rank = [n for n, w in ((RNG, want_rng), (DATALOADER, want_dl)) if w]
    elastic = want_dl and bool(meta["dataloader"].get("elastic")) and elastic_sampler_of(dataloader) is not None
    dl_ranks = _saved_loader_ranks(meta, want_dl, where)
    moved = saved_ws != topology.world_size or dl_ranks != topology.world_size
    if elastic and moved:
        if want_rng and saved_ws != topology.world_size:
            base = meta["rng"].get("base_seed")
            base = base if isinstance(base, int) and not isinstance(base, bool) else 0
            plan.rederive_rng = (base, meta.get("step", 0), topology.rank)
            want_rng = False
        plan.elastic_from = dl_ranks
    elif moved and per_rank:
        msg = (
            f"{where} was saved by {saved_ws} rank(s) and this job has {topology.world_size}: its "
            f"per-rank {' and '.join(per_rank)} state cannot be mapped onto the new ranks"
        )
        if not allow_topology_change:
            raise TopologyChangeError(
                f"{msg}. Restart with {saved_ws} rank(s), or pass CheckpointManager(..., "
                "allow_topology_change=True) to restore the model, optimizer and other state and "
                "keep each rank's current RNG and dataloader state (docs/manager.md).",
                path=where,
                key=", ".join(per_rank),
            )
        plan.notes.append(f"{msg}; skipped (allow_topology_change=True): each rank keeps its current one")
        want_rng = want_dl = False
    if want_dl:
        want_dl = _loader_settings_allow(plan, meta, dataloader, elastic, dl_ranks, allow_topology_change)
    return PerRank(rng=want_rng, loader=want_dl)
