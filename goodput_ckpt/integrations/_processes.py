"""What every process of a trainer's job holds, gathered where one process writes the checkpoint,
and how loaded state goes back into the trainer's objects.

The Hugging Face Trainer and Accelerate write a checkpoint from one process but keep one RNG
state per process (their own formats write one ``rng_state_<i>`` file per process). Our
adapters write one checkpoint location from the main process, so each process's RNG state
travels to it first: a list by process index, a few KiB per process.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import CheckpointError
from ..state.rng import check_rng, restore_rng

__all__ = ["gather_per_process", "load_into", "restore_process_rng"]

logger = logging.getLogger("goodput_ckpt.integrations")


def gather_per_process(value: Any) -> list[Any]:
    """``value`` from every process of the default process group, by rank (one process, or no
    process group: a one-item list). Every process must call this (a collective)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def restore_process_rng(rngs: Any, index: int, world: int, where: str) -> bool:
    """Set this process's RNG streams from ``rngs`` (what :func:`gather_per_process` gathered
    from :func:`~goodput_ckpt.state.rng.capture_rng` at the save).

    Returns:
        ``False`` when the checkpoint holds no state for a world of ``world`` processes (saved
        without it, or by a job of another size): nothing was changed, and it is logged, as the
        trainers' own loaders do.

    Raises:
        CheckpointError: this process's state is not one a capture makes; no generator changed.
    """
    if not isinstance(rngs, list) or len(rngs) != world:
        logger.warning("%s holds no RNG state for %d process(es): the random streams are not restored", where, world)
        return False
    state = rngs[index]
    try:
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError("it is not a mapping of generator names to tensors")
        check_rng(state)
    except (ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(
            f"{where}: the RNG state of process {index} is unusable: {e}", path=where, key="rng"
        ) from e
    for note in restore_rng(state):
        logger.warning("%s: %s", where, note)
    return True


def load_into(obj: Any, state: Any, what: str, where: str, **kwargs: Any) -> None:
    """``obj.load_state_dict(state, **kwargs)``, with a state that does not fit (missing or
    unexpected keys, other shapes, another number of parameter groups) raised as a
    :class:`CheckpointError` naming ``what`` and the checkpoint, not the object's own error.

    Raises:
        CheckpointError: ``obj`` refused ``state``; the original error is its cause.
    """
    try:
        obj.load_state_dict(state, **kwargs)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CheckpointError(
            f"{where}: the saved {what} state does not fit this {what}: {e}", path=where, key=what
        ) from e
