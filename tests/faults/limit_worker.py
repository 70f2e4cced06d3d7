"""The process side of the file-size-limit test (test_storage_full.py), run in a forked child.

:func:`run` lowers ``RLIMIT_FSIZE`` for this process only (and ignores ``SIGXFSZ``, so an
oversized write fails with ``EFBIG`` instead of killing the process), then:

1. saves a state dict over the limit with ``dcp.save`` and ``CheckpointWriter``;
2. runs a training loop with an async :class:`CheckpointManager`: small steps that fit, one
   step whose model grew over the limit, then small steps again, without stopping.

What happened is written to ``out`` as JSON for the test to check.
"""

from __future__ import annotations

import json
import resource
import signal
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from crash_worker import TrialModel
from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["run"]


def _describe(err: BaseException | None) -> dict[str, Any] | None:
    if err is None:
        return None
    return {"type": type(err).__name__, "message": str(err), "path": getattr(err, "path", None)}


def run(location: str, root: str, out: str, *, limit: int, small_kib: int, big_kib: int) -> None:
    from goodput_ckpt import CheckpointManager, CheckpointWriter
    from goodput_ckpt.errors import find_checkpoint_error

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    torch.set_num_threads(1)
    result: dict[str, Any] = {}

    # 1. One save over the limit, straight through DCP.
    try:
        dcp.save({"big": torch.ones((2 * limit) // 4)}, storage_writer=CheckpointWriter(location))
        result["direct"] = None
    except CheckpointException as e:
        found = find_checkpoint_error(e)
        result["direct"] = _describe(found) or {"type": "none found", "message": str(e)[-2000:]}

    # 2. The training loop: step 3's model is over the limit.
    calls: list[tuple[int, dict[str, Any] | None]] = []
    small, big = TrialModel(small_kib), TrialModel(big_kib)
    mgr = CheckpointManager(
        root, keep_last=5, on_error=lambda step, err: calls.append((step, _describe(err))), timeline=False
    )
    trained = []
    for step in range(1, 6):
        model = big if step == 3 else small
        model.fill(step)
        mgr.save(step, model=model, extra={"step": step})
        trained.append(step)  # the loop goes on whatever happened to the previous save
    try:
        mgr.wait()
        result["wait"] = None
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result["wait"] = _describe(e)
    try:
        mgr.wait()  # reported once
        result["second_wait"] = None
    except Exception as e:  # noqa: BLE001
        result["second_wait"] = _describe(e)
    result.update(
        trained=trained,
        on_error=calls,
        last_error=_describe(mgr.last_error),
        steps=mgr.steps(),
    )
    mgr.close()
    with open(out, "w") as f:
        json.dump(result, f)
