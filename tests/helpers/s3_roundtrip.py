"""Saving a state to an S3 target (a ``helpers.store_fixtures`` server) and loading it back, at
the sizes S3 needs: the storage tests and the fault matrix share one definition."""

from __future__ import annotations

from typing import Any

import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointReader, CheckpointWriter
from helpers.trees import make_state, zeros_like

__all__ = ["CHUNK", "MiB", "load", "s3_state", "save"]

MiB = 1 << 20
#: S3's smallest part: the most parts for the bytes moved.
CHUNK = 5 * MiB


def s3_state(seed: int = 0) -> dict[str, Any]:
    """:func:`helpers.make_state` with every awkward value and a first item ``w`` of 18 MB: four
    5 MiB parts, so one tensor crosses part and chunk boundaries."""
    return make_state(seed, numel=4_500_000, awkward=True)


def save(state: dict[str, Any], target: Any, prefix: str, **kw: Any) -> None:
    """``dcp.save`` to ``target.uri(prefix)``; ``kw`` are store options plus ``chunk_size``."""
    chunk_size = kw.pop("chunk_size", CHUNK)
    dcp.save(state, storage_writer=CheckpointWriter(target.uri(prefix), chunk_size=chunk_size, **target.options(**kw)))


def load(state: dict[str, Any], target: Any, prefix: str, **kw: Any) -> dict[str, Any]:
    """``dcp.load`` into :func:`helpers.zeros_like` of ``state``, and return it."""
    dest = zeros_like(state)
    dcp.load(dest, storage_reader=CheckpointReader(target.uri(prefix), **target.options(**kw)))
    return dest
