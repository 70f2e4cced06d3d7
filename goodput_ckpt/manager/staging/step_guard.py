"""Hold each optimizer's next ``step()`` until the copies an async save deferred are done.

``CheckpointManager.save`` (with ``async_staging``) copies the parameters and the optimizer
state after it returns, behind the next forward and backward (:mod:`.deferred_copy`).
The optimizer step is what changes those tensors, so an optimizer step pre-hook finishes the
copies first. The hook is registered once per optimizer and stays until the manager closes:
removing a hook while ``step()`` iterates over the hooks would break that iteration, and a
hook with nothing pending costs one attribute read.

Which tensors may be deferred: the parameters of the optimizers passed to ``save`` and those
optimizers' state tensors (:func:`guarded_tensor_keys`). Everything else (buffers, which a
forward pass may update, frozen parameters, RNG and dataloader state, other objects) is copied
before ``save`` returns.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from .deferred_copy import DeferredCopies

__all__ = ["StepGuard", "guarded_tensor_keys", "tensor_key"]

logger = logging.getLogger("goodput_ckpt.manager")


def tensor_key(t: torch.Tensor) -> tuple[int, int]:
    """Identifies a tensor's memory: a state dict holds views (``detach()``) of the live tensors."""
    local = getattr(t, "_local_tensor", None)  # a DTensor: its shard on this rank
    if isinstance(local, torch.Tensor):
        t = local
    return t.data_ptr(), t.numel() * t.element_size()


def guarded_tensor_keys(optimizers: Iterable[torch.optim.Optimizer]) -> set[tuple[int, int]]:
    """The :func:`tensor_key` of every CPU parameter and state tensor of ``optimizers``: the
    tensors that only their ``step()`` changes."""
    keys: set[tuple[int, int]] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            keys.update(tensor_key(p) for p in group["params"] if p.device.type == "cpu")
        for state in opt.state.values():
            keys.update(tensor_key(v) for v in state.values() if isinstance(v, torch.Tensor) and v.device.type == "cpu")
    keys.discard((0, 0))  # empty tensors share no memory worth tracking
    return keys


class StepGuard:
    """The optimizer hooks of one manager, and the deferred copies they finish."""

    def __init__(self) -> None:
        self._pending: DeferredCopies | None = None
        self._hooked: dict[int, tuple[weakref.ref, Any]] = {}  # id(optimizer) -> (ref, handle)

    def can_guard(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt`` supports step pre-hooks (every ``torch.optim.Optimizer`` does)."""
        return callable(getattr(opt, "register_step_pre_hook", None))

    def watch(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Hook ``optimizers`` (once each)."""
        for opt in optimizers:
            known = self._hooked.get(id(opt))
            if known is not None and known[0]() is opt:
                continue
            handle = opt.register_step_pre_hook(self._before_step)
            self._hooked[id(opt)] = (weakref.ref(opt), handle)

    @property
    def pending(self) -> DeferredCopies | None:
        """The copies of the latest async save (``None`` before the first, or once closed),
        for reading their state: ``done`` (every piece copied), ``confirmed`` (a training thread
        confirmed them: an optimizer step or ``wait_staged``). Finished ones stay until the next
        :meth:`arm`."""
        return self._pending

    def arm(self, copies: DeferredCopies) -> None:
        """The copies the next optimizer step must wait for (the previous ones are done)."""
        self._pending = copies

    def finish_pending(self) -> None:
        """Finish and confirm the pending copies in the calling (training) thread, whose time
        here counts as stall (:meth:`DeferredCopies.confirm`)."""
        copies = self._pending
        if copies is not None and not copies.confirmed:
            try:
                copies.confirm()
            except Exception as e:  # noqa: BLE001 - never stop training; the save reports it
                logger.error("finishing the deferred staging copies failed: %s", e)

    def _before_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.finish_pending()

    def close(self) -> None:
        """Remove every hook. Idempotent."""
        for _, handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        self._pending = None
