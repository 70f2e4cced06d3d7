"""Incremental checkpoints for tests: a model with a frozen base and a small trainable head,
saved with ``CheckpointWriter(reuse=...)`` as a manager would (one step directory each)."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from goodput_ckpt import CheckpointReader, CheckpointWriter
from goodput_ckpt.dcp.incremental import IncrementalTracker
from goodput_ckpt.errors import as_checkpoint_error


def frozen_model(seed: int = 0, base: int = 128) -> torch.nn.Sequential:
    """A ``base x base`` frozen linear layer and a trainable 4-output head."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(base, base), torch.nn.Linear(base, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    model[0].requires_grad_(False)
    return model


def save_steps(root: str, model: torch.nn.Module, steps, *, full_every: int = 100, tracker=None, **writer_kw):
    """Save ``model`` at each of ``steps`` under ``root/step_XXXXXXXX``, changing the head in place
    before each; returns the tracker and the writers (their byte counters)."""
    tracker = tracker or IncrementalTracker(full_every)
    writers = []
    for step in steps:
        with torch.no_grad():
            model[1].weight.add_(1.0)
        state = {"model": model.state_dict(), "step": step}
        loc = f"step_{step:08d}"
        plan = tracker.plan(state, [model], location=loc)
        w = CheckpointWriter(os.path.join(root, loc), reuse=plan, **writer_kw)
        dcp.save(state, storage_writer=w)
        tracker.committed(plan)
        writers.append(w)
    return tracker, writers


def load_model(uri: str, **reader_kw) -> dict[str, torch.Tensor]:
    """The model state saved at ``uri``, loaded into a fresh model of the same shape."""
    dest = {"model": frozen_model(seed=99).state_dict(), "step": -1}
    for t in dest["model"].values():
        t.zero_()
    try:
        dcp.load(dest, storage_reader=CheckpointReader(uri, **reader_kw))
    except CheckpointException as e:  # torch's wrapper (a BaseException): our typed error inside
        raise as_checkpoint_error(e, f"loading {uri}") from None
    return dest["model"]
