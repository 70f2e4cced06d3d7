"""The manager's side of incremental saves (``CheckpointManager(incremental=...)``): one
:class:`~goodput_ckpt.dcp.incremental.IncrementalTracker` per rank, a plan per save, and the
plan promoted to the reference base only once its save committed.

Why here and not in ``checkpoint_manager.py``: the manager calls three methods (``plan`` before
staging, ``committed`` after a commit, ``reset`` before a restore), and the rules of what may be
referenced live in :mod:`goodput_ckpt.dcp.incremental`.
"""

from __future__ import annotations

from typing import Any

from ..dcp.incremental import DEFAULT_FULL_EVERY, IncrementalPlan, IncrementalTracker
from ..state.modules import ModelSet
from .step_layout import step_dir_name

__all__ = ["IncrementalSaves"]


class IncrementalSaves:
    """What this rank's committed saves stored, and the plan of the save in flight."""

    def __init__(self, full_every: int) -> None:
        self.tracker = IncrementalTracker(full_every)
        self._pending: tuple[int, IncrementalPlan] | None = None
        #: This rank's last committed save: bytes written, bytes referenced, whether it was full.
        self.last: tuple[int, int, bool] | None = None

    @classmethod
    def open(cls, setting: bool | int) -> IncrementalSaves | None:
        """``None`` for ``incremental=False``; else the saves with ``True`` -> every
        :data:`~goodput_ckpt.dcp.incremental.DEFAULT_FULL_EVERY`-th save full, ``n`` -> every ``n``-th."""
        if setting is False:
            return None
        return cls(DEFAULT_FULL_EVERY if setting is True else int(setting))

    def plan(self, step: int, state: dict[str, Any], models: ModelSet) -> IncrementalPlan:
        """The plan of the save of ``step`` (with the live state, before staging). After a save
        that never committed (it failed: the next ``plan`` comes only after the previous save
        finished), the base is forgotten and this save is full: whatever failed (a replica
        without a referenced file, a tier that lost a base) is not referenced again."""
        if self._pending is not None:
            self.tracker.reset()
        plan = self.tracker.plan(state, [m for m, _ in models.pairs.values()], location=step_dir_name(step))
        self._pending = (step, plan)
        return plan

    def unstaged(self) -> frozenset[str]:
        """The keys of the pending plan's unchanged tensors, which an async save need not stage
        (the writer references them and never reads their bytes; it refuses to write one):
        recorded on the plan, so that its writer knows."""
        if self._pending is None:
            return frozenset()
        plan = self._pending[1]
        plan.unstaged = frozenset(plan.reusable)
        return plan.unstaged

    def committed(self, step: int) -> None:
        """After the save of ``step`` committed (every rank): it becomes the reference base."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == step:
            plan = pending[1]
            self.tracker.committed(plan)
            self.last = (plan.bytes_written, plan.bytes_referenced, plan.full)

    def reset(self) -> None:
        """Before a restore: the next save writes everything."""
        self._pending = None
        self.tracker.reset()
