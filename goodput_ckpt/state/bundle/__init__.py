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
(:func:`plan_restore`); :mod:`..apply` decodes what DCP filled and loads it into the live
objects. ``extra`` is the user's JSON.

Elastic loaders (``goodput_ckpt.data.ElasticSampler`` as sampler, ``TokenStream`` as dataset)
are the exception: their per-rank blobs together hold a global data position, so a restore under
another topology hands *every* old rank's blob to the loader's position holder, and re-derives
the RNG (``state.rng``) instead of refusing. What their states share on every rank is stored
once per job, in the metadata (``dataloader.job_position``), not in every row; a restore joins
each row it decodes to it (``state.dataloader``, *State stored once per job*). Only the
coordinator (rank 0 of the checkpoint group) reads those blobs from storage; the others receive
their bytes from it (:mod:`..loader_share`): W_old reads per restore instead of W_old x W_new.

The package, one job per module: :mod:`.meta` (names, the schema, the metadata check),
:mod:`.save` (the save's state dict), :mod:`.plan` (``RestorePlan`` and :func:`plan_restore`,
which runs the checks, then :mod:`.policy` for the per-rank state, then the plan step of each
section in :mod:`.sections`: models, other stateful objects, RNG, dataloader, elastic dataloader).
:mod:`goodput_ckpt.state.apply` holds each section's apply step, in the same order.
"""

from ..per_rank import rank_key
from .meta import (
    EXTRA_KEY,
    META_KEY,
    READ_SCHEMAS,
    RESERVED_NAMES,
    SCHEMA_VERSION,
    Topology,
    check_stateful,
    training_meta,
)
from .plan import RestorePlan, plan_restore
from .save import build_save_state

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
