"""The save side of the bundle: the state dict one ``CheckpointManager.save`` gives DCP, and the
training-state metadata that lets a restore check it (the sections are listed in :mod:`.`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...dcp.rank_rows import RankRow
from ..dataloader import JOB_POSITION, check_dataloader, describe_dataloader, encode_dataloader_row, split_loader_state
from ..modules import ModelSet, tied_keys
from ..per_rank import DATALOADER, RNG, ROWS
from ..rng import capture_rng, describe_rng, pack_rng, rng_layout
from .meta import (
    EXTRA_KEY,
    META_KEY,
    MODEL,
    OPTIMIZER,
    SCHEMA_VERSION,
    Topology,
    check_stateful,
)

__all__ = ["build_save_state"]


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
        # The part every rank shares goes into the metadata, which the coordinator commits: once per job.
        row_state, job = split_loader_state(dataloader)
        row = encode_dataloader_row(dataloader, key=f"{DATALOADER}.{ROWS}", state=row_state)
        state[DATALOADER] = {ROWS: RankRow(row, topology.rank, topology.world_size, widen=True)}
        meta["dataloader"] = describe_dataloader(dataloader)
        if job is not None:
            meta["dataloader"][JOB_POSITION] = job
    for name, obj in stateful.items():
        state[name] = obj.state_dict()
    meta["sections"] = list(state)
    return state, {META_KEY: meta, EXTRA_KEY: dict(extra or {})}
