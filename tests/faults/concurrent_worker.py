"""The writer side of the concurrency tests (test_concurrency.py), run in forked children.

:func:`save_when_told` builds the state of writer ``seed`` (:func:`writer_state`), says it is
ready, waits for the test's go file, sleeps its own random skew, saves with ``dcp.save`` and
``CheckpointWriter`` to a location another writer may be saving to at the same moment, and
writes what happened to ``out`` as JSON.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

__all__ = ["save_when_told", "writer_state"]

MiB = 1 << 20


def writer_state(seed: int, mib: int) -> dict[str, Any]:
    """Writer ``seed``'s state: the same keys and shapes for every writer, other values."""
    g = torch.Generator().manual_seed(seed)
    n = mib * MiB // 4
    return {
        "w": torch.randn(n - 4096, generator=g),
        "b": torch.randint(0, 1 << 30, (1024,), generator=g),
        "h": torch.full((3072,), float(seed)),
        "writer": seed,
    }


def save_when_told(
    location: str,
    options: dict[str, Any],
    *,
    seed: int,
    mib: int,
    chunk_size: int,
    ready: str,
    go: str,
    out: str,
    skew: float,
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from goodput_ckpt import CheckpointWriter
    from goodput_ckpt.errors import find_checkpoint_error

    torch.set_num_threads(1)
    sd = writer_state(seed, mib)
    writer = CheckpointWriter(location, chunk_size=chunk_size, **options)
    with open(ready, "w"):
        pass
    deadline = time.monotonic() + 300  # the test died if no go comes: do not linger as an orphan
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {go} after 300 s")
        time.sleep(0.0005)
    time.sleep(skew)
    result: dict[str, Any] = {"seed": seed}
    t0 = time.monotonic()
    try:
        dcp.save(sd, storage_writer=writer)
        result["ok"] = True
    except CheckpointException as e:
        err = find_checkpoint_error(e)
        result.update(
            ok=False, type=type(err).__name__ if err else "CheckpointException", message=str(err or e)[-1500:]
        )
    result["seconds"] = time.monotonic() - t0
    with open(out, "w") as f:
        json.dump(result, f)
