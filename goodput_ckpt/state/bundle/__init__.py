"""The training-state bundle: what one ``CheckpointManager.save`` writes, and how it comes back.

The state dict handed to DCP has these top-level sections::

    model        model state (sharded for FSDP2), or {name: state} for a dict of models
    optimizer    optimizer state keyed by parameter names, or {name: state}
    rng          {"rows": RankRow}                   row r of uint8[W, width] (state.rng)
    dataloader   {"rows": RankRow}                   row r of uint8[W, widest] (state.dataloader)
    <name>       obj.state_dict() of every other keyword (scheduler=, scaler=, ...)

Per-rank state cannot sit under a key all ranks share as a plain tensor: DCP keeps one rank's copy
of those, and every rank would get rank 0's RNG. So each is one row per rank of one tensor
(``dcp.rank_rows``): one item in the commit record whatever the world size. The dataloader
states differ in length between ranks; the save widens their rows to the longest.

Training-state schema 1 (read, no longer written) kept both under rank-unique keys,
``rng.rank{r}.<generator>`` and ``dataloader.rank{r}``: seven items per rank, the bulk of a large
job's commit record.

The manifest's ``metadata`` holds ``{"training_state": {...}, "extra": {...}}``; the first part
records the step, the world size, the sections, and what the per-rank state depends on, so that a
restore under another topology is refused by name instead of silently misapplied
(:func:`plan_restore`); :mod:`.apply` decodes what DCP filled and loads it into the live
objects. ``extra`` is the user's JSON.

Elastic loaders (``goodput_ckpt.data.ElasticSampler`` as sampler, ``TokenStream`` as dataset)
are the exception: their per-rank blobs together hold a global data position, so a restore under
another topology hands *every* old rank's blob to the loader's position holder, and re-derives
the RNG (``state.rng``) instead of refusing. Only the coordinator (rank 0 of the checkpoint
group) reads those blobs from storage; the others receive their bytes from it
(:mod:`.loader_share`): W_old reads per restore instead of W_old x W_new.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...dcp.rank_rows import RankRow
from ...errors import CheckpointError, CorruptCheckpointError, TopologyChangeError
from ...format.manifest import Manifest
from ...format.schema import MAX_WORLD_SIZE
from ..dataloader import check_dataloader, describe_dataloader, elastic_sampler_of, encode_dataloader_row
from ..modules import ModelSet, tied_keys
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
from ..rng import capture_rng, describe_rng, pack_rng, rng_layout, row_width

__all__ = [
    "EXTRA_KEY",
    "META_KEY",
    "READ_SCHEMAS",
    "RESERVED_NAMES",
    "SCHEMA_VERSION",
    "RestorePlan",
    "Topology",
    "build_save_state",
    "check_stateful",
    "plan_restore",
    "rank_key",
    "training_meta",
]

SCHEMA_VERSION = 2
#: Training-state schemas this version restores: 1 (RNG under rank-unique keys) and 2.
READ_SCHEMAS = (1, 2)
META_KEY = "training_state"
EXTRA_KEY = "extra"
MODEL, OPTIMIZER = "model", "optimizer"
#: Section names that keyword stateful objects may not take.
RESERVED_NAMES = frozenset({MODEL, OPTIMIZER, RNG, DATALOADER, EXTRA_KEY, "step"})


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its global rank and the world size of the checkpoint group."""

    rank: int
    world_size: int


def check_stateful(stateful: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` for a keyword object that cannot be saved under its name."""
    for name, obj in stateful.items():
        if name in RESERVED_NAMES or "." in name or not name:
            raise TypeError(f"{name!r} cannot name a stateful object: reserved or contains '.'")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"{name}= must have state_dict() and load_state_dict(); got {type(obj).__name__}")


def build_save_state(
    step: int,
    *,
    models: ModelSet,
    dataloader: Any,
    stateful: Mapping[str, Any],
    topology: Topology,
    save_rng: bool,
    extra: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state dict to give DCP and the manifest metadata of one save.

    Tensors in the state dict are live (parameters, optimizer states); stage or write them
    before training continues.
    """
    check_stateful(stateful)
    state: dict[str, Any] = {}
    msd, osd = models.state_dicts()
    state[MODEL] = msd
    if osd is not None:
        state[OPTIMIZER] = osd
    meta: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "step": step,
        "world_size": topology.world_size,
        "sections": [],
        **models.describe(),
        "stateful": sorted(stateful),
        "rng": None,
        "dataloader": None,
        # Tied weights, {alias key: kept key}: the export to Hugging Face writes them once.
        "tied": tied_keys(msd, MODEL),
    }
    if save_rng:
        rng, layout = capture_rng(), rng_layout()
        state[RNG] = {ROWS: RankRow(pack_rng(rng, layout), topology.rank, topology.world_size)}
        meta["rng"] = describe_rng(rng, layout)
    if dataloader is not None:
        check_dataloader(dataloader)
        row = encode_dataloader_row(dataloader, key=f"{DATALOADER}.{ROWS}")
        state[DATALOADER] = {ROWS: RankRow(row, topology.rank, topology.world_size, widen=True)}
        meta["dataloader"] = describe_dataloader(dataloader)
    for name, obj in stateful.items():
        state[name] = obj.state_dict()
    meta["sections"] = list(state)
    return state, {META_KEY: meta, EXTRA_KEY: dict(extra or {})}


@dataclass
class RestorePlan:
    """What :func:`.apply.apply_restore` does once DCP filled ``dest``."""

    dest: dict[str, Any]
    models: ModelSet
    dataloader: Any = None
    stateful: dict[str, Any] = field(default_factory=dict)
    restore_rng: bool = False
    notes: list[str] = field(default_factory=list)
    #: Elastic data position: old ranks whose loader states go to the ElasticSampler (their
    #: count), the batch size they used, and where (for messages). 0 = not elastic.
    elastic_from: int = 0
    #: Elastic: the old ranks' loader blobs, rank order, filled before :func:`.apply.apply_restore`
    #: (schema 2: one entry, ``rows``, the whole tensor: a row per old rank).
    #: On the coordinator these are ``dest``'s own tensors (DCP reads them); elsewhere empty
    #: tensors of the sizes the manifest gives, which :func:`.loader_share.share_loader_states`
    #: fills from the coordinator's copy.
    elastic_blobs: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Whether DCP reads ``elastic_blobs`` into this rank (the coordinator) or it receives them.
    elastic_reads: bool = False
    #: The batch size the saved loader recorded (metadata, unchecked: the position holder checks
    #: it before it multiplies anything by it).
    saved_batch_size: Any = None
    #: Same topology: checks this rank's decoded loader state before anything is applied (its
    #: position holder's ``check_saved_state``; schema 2 runs it in DCP's read phase already).
    loader_check: Callable[[Any], None] | None = None
    where: str = ""
    #: Topology change: (base seed, step, new rank) this rank's generators are re-derived from.
    rederive_rng: tuple[int, int, int] | None = None
    #: Schema 2: the slots of the RNG row this rank restores (``state.rng``).
    rng_layout: list[tuple[str, str, int]] | None = None


def _position_check(plan: RestorePlan, dataloader: Any, rank: int) -> Callable[[Any], None] | None:
    """The check of ``rank``'s saved position by the loader's holder (``ElasticSampler``,
    ``TokenStream``), or ``None``; reads ``plan.saved_batch_size`` when it runs."""
    check = getattr(elastic_sampler_of(dataloader), "check_saved_state", None)
    if not callable(check):
        return None
    where = f"{plan.where}: the dataloader row of rank {rank}"
    return lambda state: check(state, batch_size=plan.saved_batch_size, where=where)


def training_meta(manifest: Manifest, where: str) -> dict[str, Any]:
    """The validated ``training_state`` metadata of a manifest.

    Raises:
        CheckpointError: the checkpoint was not written by ``CheckpointManager``.
        CorruptCheckpointError: the metadata is malformed or of an unknown schema version.
    """
    meta = manifest.metadata.get(META_KEY)
    if meta is None:
        raise CheckpointError(
            f"{where} is a checkpoint without training-state metadata (not written by "
            "CheckpointManager); load it with dcp.load and CheckpointReader instead",
            path=where,
        )

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: manifest metadata '{META_KEY}': {msg}", path=where)

    if not isinstance(meta, dict):
        raise bad("not an object")
    schema = meta.get("schema")
    if isinstance(schema, bool) or schema not in READ_SCHEMAS:
        raise CorruptCheckpointError(
            f"{where}: training-state schema version {schema!r:.40} is not supported (this goodput-ckpt "
            f"reads versions {', '.join(map(str, READ_SCHEMAS))}); upgrade goodput-ckpt",
            path=where,
            version=schema,
        )
    ws = meta.get("world_size")
    if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
        raise bad(f"world_size must be a positive integer, got {ws!r:.40}")
    step = meta.get("step", 0)  # seeds re-derived generators (state.rng.derived_seed: a signed 64-bit field)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 1 << 63:
        raise bad(f"step must be an integer in [0, 2^63), got {step!r:.40}")
    sections = meta.get("sections")
    if not isinstance(sections, list) or not all(isinstance(s, str) for s in sections):
        raise bad("sections must be a list of strings")
    for name in ("rng", "dataloader"):
        if meta.get(name) is not None and not isinstance(meta[name], dict):
            raise bad(f"{name} must be an object or null")
    for name in ("models", "optimizers"):
        v = meta.get(name)
        if v is not None and (not isinstance(v, list) or not all(isinstance(s, str) for s in v)):
            raise bad(f"{name} must be a list of strings or null")
    return meta


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
    :func:`.loader_share.share_loader_states`) and the sampler splits the epoch's
    pending samples among the new ranks; under another world size every rank's RNG is re-derived
    from the saved base seed, the step and its new rank (``state.rng``). A checkpoint without
    dataloader state (``reshard --rank-state drop``) restores with the loader left at its start.

    A fresh optimizer gets state shaped from the checkpoint, uninitialized until the load fills
    it (:mod:`.optim_state`): a caller whose load or apply fails calls
    ``models.discard_shaped_state()``, as ``CheckpointManager.restore`` does.

    Raises:
        TopologyChangeError: see above.
        CheckpointError: the caller asks for a section the checkpoint does not hold.
    """
    check_stateful(stateful)
    meta = training_meta(manifest, where)
    sections = set(meta["sections"])
    saved_ws = meta["world_size"]
    plan = RestorePlan(dest={}, models=models, where=where)

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
    missing = sorted(n for n in stateful if n not in sections)
    if missing:
        raise CheckpointError(
            f"{where} holds no state for {', '.join(f'{n}=' for n in missing)} (it holds "
            f"{', '.join(sorted(sections - {MODEL, OPTIMIZER, RNG, DATALOADER})) or 'no other objects'})",
            path=where,
        )
    if dataloader is not None:
        check_dataloader(dataloader)
        if meta.get("dataloader") is None:
            plan.notes.append(
                f"{where} holds no dataloader state (saved without one, or resharded with --rank-state "
                "drop); the dataloader starts from its beginning"
            )
            dataloader = None
    elif meta.get("dataloader") is not None:
        plan.notes.append("the checkpoint holds dataloader state but restore got no dataloader=; it was not restored")

    # -- per-rank state and the topology ------------------------------------------------------
    want_rng = meta.get("rng") is not None
    want_dl = dataloader is not None
    per_rank = [n for n, w in ((RNG, want_rng), (DATALOADER, want_dl)) if w]
    elastic = want_dl and bool(meta["dataloader"].get("elastic")) and elastic_sampler_of(dataloader) is not None
    # How many ranks' loader states there are: the saving world size, unless ``reshard`` carried
    # elastic positions over to another world size (it records the old one as "ranks").
    dl_ranks = meta["dataloader"].get("ranks", saved_ws) if want_dl else saved_ws
    # Bounded like the manifest's world size: each of these ranks costs a blob template here.
    if isinstance(dl_ranks, bool) or not isinstance(dl_ranks, int) or not 1 <= dl_ranks <= MAX_WORLD_SIZE:
        raise CorruptCheckpointError(
            f"{where}: dataloader ranks must be an integer in [1, {MAX_WORLD_SIZE}]", path=where, key=DATALOADER
        )
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
        saved_dl, now_dl = meta["dataloader"], describe_dataloader(dataloader)
        diffs = [
            f"{k} {saved_dl.get(k)} -> {now_dl[k]}"
            for k in ("num_workers", "batch_size")
            if saved_dl.get(k) is not None and now_dl[k] is not None and saved_dl.get(k) != now_dl[k]
        ]
        if elastic and diffs:
            plan.elastic_from = dl_ranks
        elif diffs:
            msg = f"the dataloader differs from the one saved in {where} ({', '.join(diffs)}): its position cannot be restored"
            if not allow_topology_change:
                raise TopologyChangeError(
                    f"{msg}. Use the saved settings, or pass CheckpointManager(..., "
                    "allow_topology_change=True) to start this dataloader from its current state.",
                    path=where,
                    key=DATALOADER,
                )
            plan.notes.append(f"{msg}; skipped (allow_topology_change=True)")
            want_dl = False

    # -- the destination DCP loads into --------------------------------------------------------
    def saved(name: str) -> dict[str, Any]:
        return saved_states(manifest, f"{OPTIMIZER}.{name}.state." if models.named else f"{OPTIMIZER}.state.")

    msd, osd = models.state_dicts(saved)  # called only for models with optimizers
    plan.dest[MODEL] = msd
    if models.has_optimizer:
        plan.dest[OPTIMIZER] = osd
    rk, ws = rank_key(topology.rank), topology.world_size
    schema1 = meta["schema"] == 1
    if want_rng:
        if schema1:
            plan.dest[RNG] = {rk: rng_templates(manifest, topology.rank, where)}
        else:
            plan.rng_layout = rng_layout_of(meta, META_KEY, where)
            width = rows_width(manifest, RNG, ws, row_width(plan.rng_layout), where)
            plan.dest[RNG] = {ROWS: rng_row(width, topology.rank, ws, plan.rng_layout, where)}
        plan.restore_rng = True
    if plan.elastic_from:
        if schema1:
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
    elif want_dl:
        plan.saved_batch_size = meta["dataloader"].get("batch_size")
        plan.loader_check = _position_check(plan, dataloader, topology.rank)
        if schema1:
            plan.dest[DATALOADER] = {rk: blob_template(manifest, f"{DATALOADER}.{rk}", where)}
        else:
            width = rows_width(manifest, DATALOADER, ws, None, where)
            plan.dest[DATALOADER] = {ROWS: loader_row(width, topology.rank, ws, plan.loader_check)}
        plan.dataloader = dataloader
    for name, obj in stateful.items():
        plan.dest[name] = obj.state_dict()
        plan.stateful[name] = obj
    return plan
