"""The manager's async staging: what ``save`` copies now, what it leaves to later, and who waits.

An async save stages the state into buffers that a :class:`~.stager.ReusableStager` keeps from
save to save. With ``async_staging`` only what a forward pass may change is copied in the
caller's thread; the parameters and optimizer states of the optimizers passed to ``save`` are
left to a :class:`~.deferred_copy.DeferredCopies` that the save thread finishes behind the next
forward and backward, and a pre-hook on each of those optimizers' ``step()``
(:class:`~.step_guard.StepGuard`) finishes them first when the step comes sooner.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from .deferred_copy import DeferredCopies
from .stager import ReusableStager
from .step_guard import StepGuard, guarded_tensor_keys, tensor_key

__all__ = ["AsyncStaging"]


class AsyncStaging:
    """One manager's stager and optimizer step guard.

    Call order, at most one save at a time::

        staged, later = staging.stage(state, models)   # training thread: the blocking part
        staging.arm(later)                              # the next optimizer step finishes ``later``
        ... the save thread: later.finish(), writes ``staged`` ...
        staging.release()                               # the save thread, once it is written
        staging.finish_pending()                        # training thread: before other changes

    Args:
        defer: leave the optimizers' tensors to the save thread (``async_staging``); ``False``
            copies everything in :meth:`stage`.
        timeout_s: the longest wait for buffers the previous save still holds.
    """

    def __init__(self, *, defer: bool, timeout_s: float) -> None:
        self.defer = defer
        self.stager = ReusableStager(timeout_s=timeout_s)
        self.guard = StepGuard()

    def stage(
        self, state: dict[str, Any], models: Any, skip: Collection[str] = ()
    ) -> tuple[dict[str, Any], DeferredCopies]:
        """Copy ``state`` into the kept buffers, all but what may be deferred (see the class) and
        the tensors of ``skip`` (an incremental save's unchanged ones: ``ReusableStager.stage_deferred``).

        ``models`` is the normalized ``(model, optimizers)`` pairs of ``save``
        (:func:`goodput_ckpt.state.normalize`).

        Raises:
            CheckpointError: the previous save still holds the buffers after ``timeout_s``.
        """
        return self.stager.stage_deferred(state, self._deferrable(models), skip)

    def _deferrable(self, models: Any) -> Callable[[Any], bool] | None:
        """Which sources ``save`` may leave to the save thread: the tensors of the optimizers
        passed to it, which only their (hooked) ``step()`` changes. ``None``: copy all now."""
        if not self.defer:
            return None
        optimizers = [o for _, opts in models.pairs.values() for o in opts if self.guard.can_guard(o)]
        keys = guarded_tensor_keys(optimizers)
        if not keys:
            return None
        self.guard.watch(optimizers)
        return lambda t: tensor_key(t) in keys

    def arm(self, later: DeferredCopies) -> None:
        """The copies the next optimizer step must finish first."""
        self.guard.arm(later)

    def finish_pending(self) -> None:
        """Finish and confirm the pending deferred copies in the calling (training) thread."""
        self.guard.finish_pending()

    def release(self) -> None:
        """The staged copy is written (or given up): the next ``stage`` may reuse the buffers."""
        self.stager.release()

    def close(self) -> None:
        """Remove the optimizer hooks and drop the buffers. Idempotent."""
        self.guard.close()
        self.stager.close()
