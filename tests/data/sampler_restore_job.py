"""Rank functions of test_sampler_restore.py, run on real gloo processes by
``helpers.dist.run_ranks``: an ``ElasticSampler`` behind a ``StatefulDataLoader``, saved and
restored through ``CheckpointManager`` (issue 34's three bugs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from helpers.datasets import Ids

from goodput_ckpt import CheckpointManager
from goodput_ckpt.data import ElasticSampler

BATCH = 2


def _loader(n: int, rank: int, world: int, batch: int = BATCH, **kwargs):
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = ElasticSampler(Ids(n), shuffle=True, seed=5, num_replicas=world, rank=rank, **kwargs)
    return sampler, StatefulDataLoader(Ids(n), batch_size=batch, sampler=sampler)


def train_and_save(rank: int, world: int, root: str, n: int, save_after: int | None, batch: int, opts: dict) -> None:
    """Read ``save_after`` batches of epoch 0 and save through the manager; ``None``: read the
    whole epoch, and save once the loop over it ended (the loader's iterator is finished)."""
    model = torch.nn.Linear(2, 1)
    sampler, loader = _loader(n, rank, world, batch, **opts)
    sampler.set_epoch(0)
    with CheckpointManager(root, async_save=False, allow_topology_change=True) as mgr:
        for i, _ in enumerate(loader):
            if i + 1 == save_after:
                mgr.save(i, model=model, dataloader=loader)
                break
        else:
            mgr.save(i, model=model, dataloader=loader)


def resume_and_read(
    rank: int, world: int, root: str, n: int, epochs: int, batch: int, opts: dict, out: str, jump_to: int | None
) -> None:
    """Restore, then the loop of docs/guide.md: ``for epoch in range(sampler.epoch, epochs)``,
    ``set_epoch(epoch)`` (or first ``set_epoch(jump_to)`` when given), recording every sample
    id read with its epoch."""
    model = torch.nn.Linear(2, 1)
    sampler, loader = _loader(n, rank, world, batch, **opts)
    with CheckpointManager(root, async_save=False, allow_topology_change=True) as mgr:
        restored = mgr.restore(model=model, dataloader=loader)
    start = sampler.epoch if jump_to is None else jump_to
    read = []
    for epoch in range(start, epochs):
        sampler.set_epoch(epoch)
        for ids in loader:
            read.extend((epoch, int(i)) for i in ids)
    Path(out, f"read-rank{rank}.json").write_text(json.dumps({"restored": restored, "start": start, "read": read}))


def each(rank: int, world: int, fn: Callable[..., None], cases: list[tuple[Any, ...]]) -> None:
    """``fn(rank, world, *case)`` for every case, in this one process group: the test runs all
    its scenarios in four gloo jobs instead of two each (a group costs 10-30 s to start on 2 cores).
    Each case's saves start as in a fresh process (no layout held from the previous case's)."""
    from goodput_ckpt.dcp.commit_build import forget_layouts

    for case in cases:
        forget_layouts()
        fn(rank, world, *case)
