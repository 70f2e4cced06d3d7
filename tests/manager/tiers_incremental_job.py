"""Rank functions of the two-tier incremental tests (test_incremental_tiers.py), run on real gloo
processes by ``helpers.dist.run_ranks``: a model whose first layer is frozen, saved through a
two-tier ``CheckpointManager(incremental=...)`` on simulated nodes (one rank per ``{node}``
directory), and restored from what is left of the tiers."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from helpers.tiers import job_dir
from tiers_job import digest, train

from goodput_ckpt import CheckpointManager
from goodput_ckpt.errors import CheckpointError

#: Two nodes of one rank each; every 4th save full, every 3rd persisted.
OPTS: dict[str, Any] = dict(replicas=1, persist_every=3, keep_last=2, incremental=4, local_world_size=1)


def make(width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model and optimizer on every rank (replicated: DCP spreads its tensors over the
    ranks), with the first layer frozen: the bytes an incremental save references."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def reference_digest(steps: int) -> dict[str, str]:
    """The digest after training steps ``0 .. steps-1`` in this process."""
    model, opt = make()
    for step in range(steps):
        train(model, opt, step)
    return digest(model, opt)


def _saves(mgr: CheckpointManager) -> dict[int, list[int | None]]:
    return {
        r["step"]: [r.get("written_bytes"), r.get("referenced_bytes")]
        for r in mgr.timeline
        if r.get("event") == "save" and r.get("ok")
    }


def save_steps(rank: int, world: int, root: str, local: str, steps: int, out: str) -> None:
    """Train and save steps ``0 .. steps-1``; write each rank's view of the tiers and its saves."""
    model, opt = make()
    with CheckpointManager(root, local_dir=local, **OPTS) as mgr:
        for step in range(steps):
            train(model, opt, step)
            mgr.save(step, model=model, optimizer=opt)
        mgr.wait()
        view = {"tiers": mgr.step_tiers(), "saves": _saves(mgr)}
    Path(out, f"saved-rank{rank}.json").write_text(json.dumps(view))


def restore_and_go_on(rank: int, world: int, root: str, local: str, out: str, go_on: bool) -> None:
    """Restore the newest step the tiers can rebuild into a zeroed model; with ``go_on``, save
    three more steps, the second after every node lost the replicas of the first (which the
    second references): that save fails, naming what its replica lacks, and the third is full."""
    model, opt = make()
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    result: dict[str, Any] = {"error": None}
    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    handler.setLevel(logging.WARNING)
    logging.getLogger("goodput_ckpt").addHandler(handler)
    with CheckpointManager(root, local_dir=local, **OPTS) as mgr:
        step = mgr.restore(model=model, optimizer=opt)
        record = [r for r in mgr.timeline if r.get("event") == "restore"][-1]
        result.update(step=step, digest=digest(model, opt), sources=record.get("sources"))
        if go_on:
            assert step is not None
            train(model, opt, step + 1)
            mgr.save(step + 1, model=model, optimizer=opt)
            mgr.wait()
            # Each node loses the replica it holds of the other rank's files of step + 1.
            other = 1 - rank
            for f in (job_dir(Path(local.format(node=rank))) / f"step_{step + 1:08d}").glob(f"rank{other:05d}-*.bin"):
                f.unlink()
            dist.barrier()
            train(model, opt, step + 2)
            mgr.save(step + 2, model=model, optimizer=opt)
            try:
                mgr.wait()
            except CheckpointError as e:
                result["failed"] = str(e)
            train(model, opt, step + 3)
            mgr.save(step + 3, model=model, optimizer=opt)
            mgr.wait()
            result["saves"] = _saves(mgr)
            result["after"] = digest(model, opt)
    result["warnings"] = warned
    Path(out, f"restored-rank{rank}.json").write_text(json.dumps(result))


def restore_each(rank: int, world: int, cases: list[tuple[str, str, str, bool]]) -> None:
    """``restore_and_go_on(rank, world, *case)`` for every case, in this one process group (a group
    costs 10-30 s to start on 2 cores); the test puts the case that saves last."""
    for case in cases:
        restore_and_go_on(rank, world, *case)
        dist.barrier()
