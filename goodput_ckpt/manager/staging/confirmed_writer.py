"""A ``CheckpointWriter`` for a state whose staging copies finish after ``dcp.save`` began.

With async staging (:mod:`.deferred_copy`) a rank learns only late whether its staged copy is
good: when its last piece is copied, and for certain at the last comparison of the sources'
versions (the training thread's confirmation, or just before the commit). Each rank must not
decide alone: a rank that skipped ``dcp.save`` after a failed copy would leave the others waiting
in its collectives, pair their next save with its own, and let the coordinator commit a manifest
whose files sit in another step's directory. So the checks run inside DCP's collective phases,
where DCP gathers a failure on any rank and raises it on every rank:

- ``prepare_local_plan``: a copy already known to have failed fails the save before anything
  is written;
- ``write_data``, after this rank's files are written: the last comparison, then the check. The
  coordinator commits (``finish``) only when every rank passed, so a failed copy never reaches a
  manifest; its files are left without one, visibly incomplete, and removed with other
  incomplete checkpoints.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from ...dcp.writer import CheckpointWriter
from ...errors import CheckpointError
from .deferred_copy import DeferredCopies

__all__ = ["ConfirmedWriter"]


class ConfirmedWriter(CheckpointWriter):
    """``CheckpointWriter(uri, **kw)`` that commits only when ``copies`` are good on every rank
    (see the module docstring). Not for ``dcp.async_save``'s process executor.

    Attributes:
        copies: the deferred staging copies of the state being saved; set it before ``dcp.save``
            (the writer is made before staging, so that its set-up is not part of the stall).
        failure: set instead of ``copies`` when this rank could not stage at all: the save then
            fails in its first collective phase on every rank, with this error.
    """

    def __init__(self, uri: Any, **kw: Any) -> None:
        super().__init__(uri, **kw)
        self.copies: DeferredCopies | None = None
        self.failure: BaseException | None = None

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("ConfirmedWriter holds live staging copies and cannot be pickled (process executor)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._checked(final=False)
        return super().prepare_local_plan(plan)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        fut = super().write_data(plan, planner)
        self._checked(final=True)
        return fut

    def _checked(self, *, final: bool) -> None:
        try:
            if self.failure is not None:
                raise self.failure
            if self.copies is None:
                raise CheckpointError("ConfirmedWriter.copies was not set before the save")
            if final:
                self.copies.check_before_commit()
            self.copies.result()
        except BaseException:
            self._release()  # the coordinator's claim would otherwise last until finish()
            raise
