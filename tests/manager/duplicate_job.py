"""Rank function of test_duplicate_save.py, run on real gloo processes by
``helpers.dist.run_ranks``: saves of steps that already exist, on one tier and on two."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from goodput_ckpt import CheckpointExistsError, CheckpointManager


def _refused(mgr: CheckpointManager, step: int, model: torch.nn.Module) -> str | None:
    """The message of the ``CheckpointExistsError`` that ``save(step)`` raises at the call."""
    try:
        mgr.save(step, model=model)
    except CheckpointExistsError as e:
        return str(e)
    return None


def duplicate_saves(rank: int, world: int, base: str) -> None:
    model = torch.nn.Linear(8, 8)
    out: dict[str, object] = {}
    root, local = f"{base}/root", f"{base}/local/node{{node}}"
    with CheckpointManager(root) as mgr:  # async saves
        mgr.save(1, model=model)
        mgr.save(2, model=model)
        out["same_manager"] = _refused(mgr, 1, model)  # saved by this manager
        mgr.save(3, model=model)  # the manager goes on
    with CheckpointManager(root, async_save=False) as mgr:
        out["listed"] = _refused(mgr, 2, model)  # found committed at the first save
        mgr.save(4, model=model)
    with CheckpointManager(root, overwrite=True) as mgr:
        mgr.save(4, model=model)
        out["overwrite"] = "ok"
    with CheckpointManager(f"{base}/root2", local_dir=local, local_world_size=1, persist_every=2) as mgr:
        mgr.save(1, model=model)  # local only (persist_every=2)
    with CheckpointManager(f"{base}/root2", local_dir=local, local_world_size=1, persist_every=2) as mgr:
        out["local_tier"] = _refused(mgr, 1, model)
    Path(base, f"dup-rank{rank}.json").write_text(json.dumps(out))
