"""Subprocess half of test_incremental_manager.py: a LoRA job that saves incrementally and is killed.

Usage: ``python incremental_job.py ROOT KILL_AT``. Trains steps 1, 2, ... with a
``CheckpointManager(incremental=3, keep_last=2)`` (async saves), saving after every step. After
each save is staged, ``ROOT/../expected_STEP.pt`` gets the model's and optimizer's state of
that step; after the save of ``KILL_AT`` returns (its write in flight), the process SIGKILLs
itself.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from helpers.lora import adapter_optimizer, lora_model, train_step

from goodput_ckpt import CheckpointManager


def main(root: str, kill_at: int) -> None:
    torch.manual_seed(0)
    model = lora_model()
    opt = adapter_optimizer(model)
    mgr = CheckpointManager(root, keep_last=2, incremental=3, async_save=True)
    out = os.path.dirname(os.path.abspath(root))
    for step in range(1, kill_at + 1):
        train_step(model, opt, step)
        mgr.save(step, model=model, optimizer=opt)
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, os.path.join(out, f"expected_{step}.pt"))
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        mgr.wait()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
