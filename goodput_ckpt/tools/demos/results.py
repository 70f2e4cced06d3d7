"""What the demos report: :class:`DemoReport` (``goodput-ckpt demo``), :class:`TierDemoReport`
and its :class:`DemoMode` per tier layout (``demo --tiers``), rendered by ``cli/demo.py`` and
``cli/_demo_tiers.py``.

Both demos kill a job, restart it and compare it with an uninterrupted run; what they find about
that one resumed run is :class:`ResumedRun`, one type for both, so that "resumed exactly and
every checkpoint verified" (``ok``) and the time accounting mean the same in both reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..measure.plan_two_level import TwoLevelPlan

__all__ = ["SYNC_BASIS", "DemoMode", "DemoReport", "ResumedRun", "TierDemoReport"]

SYNC_BASIS = (  # how the synchronous estimate is made, for the report (demo.py's docstring)
    "estimated, not measured: this run's time with each kept save's stall replaced by a blocking save; "
    "the lost work, restart, restore and the unexplained 'other' time are charged to both"
)


@dataclass(kw_only=True)
class ResumedRun:
    """One checkpointed run, killed and restarted, against the uninterrupted reference.

    Attributes:
        save_in_flight_at_kill: the step whose save was still being written at the kill, if any.
        restored_step: the step the restart restored (``None``: none).
        bit_exact, values_compared, mismatches: the resumed run's end state against the reference's.
        checkpoints: every complete step verified (``ok``, ``step``, ``status``, ``bytes``, ...).
        seconds: the checkpointed run's wall time split (``training``, ``stall``, ``lost``,
            ``restart``, ``restore``, ``other``, ``total``; ``demo.py``'s docstring).
        goodput: ``training / total``. ``saves_kept``, ``stall_per_save_s``: the saves whose work
            was kept and their median stall.
    """

    save_in_flight_at_kill: int | None
    restored_step: int | None
    bit_exact: bool
    values_compared: int
    mismatches: list[str]
    checkpoints: list[dict[str, Any]]
    seconds: dict[str, float]
    goodput: float
    saves_kept: int
    stall_per_save_s: float

    @property
    def ok(self) -> bool:
        """Resumed bit for bit, and every checkpoint left verified."""
        return self.bit_exact and bool(self.checkpoints) and all(c["ok"] for c in self.checkpoints)


@dataclass(kw_only=True)
class DemoReport(ResumedRun):
    """What the one-tier demo found (:class:`ResumedRun`), with its job and the synchronous
    estimate. ``ok``: the resumed run matched and every checkpoint verified."""

    root: str
    device: str
    steps: int
    save_every: int
    world_size: int
    killed_after_step: int
    sync_save_s: float
    goodput_sync: float
    reference_s: float
    logs: str
    #: How ``goodput_sync`` was obtained (:data:`SYNC_BASIS`).
    sync_basis: str = SYNC_BASIS


@dataclass(kw_only=True)
class DemoMode(ResumedRun):
    """One tier layout's run of the same job and failure (:class:`ResumedRun`).

    Attributes:
        name: ``"one tier"`` or ``"two tiers"``.
        root: the persistent tier; ``local_dir``: the node-local template (two tiers only).
        restored_from: the tiers the restore read data files from, in restore order;
            ``restore_files``: data files per tier, summed over the ranks (two tiers only: the
            one-tier manager reads its root and does not count).
        background_per_save_s: median time from the end of a save's stall until it was durable
            on its first tier (two tiers: with its replica), the slowest rank per save.
        persist_per_save_s: two tiers: median time of a background persist (slowest rank).
    """

    name: str
    root: str
    local_dir: str | None
    persist_every: int | None
    restored_from: list[str]
    restore_files: dict[str, int]
    background_per_save_s: float | None
    persist_per_save_s: float | None


@dataclass
class TierDemoReport:
    """What the two-tier demo found: ``modes[0]`` one tier, ``modes[1]`` two tiers.
    ``lost_node``: the node whose local directory the failure deleted (``None``: only a kill).

    ``gain``: two tiers' goodput minus one tier's, in percentage points, measured. ``model``: the
    two-level plan for the measured costs (``None`` when a cost was not measured).
    """

    device: str
    steps: int
    save_every: int
    world_size: int
    nodes: int
    local_world_size: int
    killed_after_step: int
    lost_node: int | None
    reference_s: float
    modes: list[DemoMode]
    gain: float
    node_mtbf: float
    job_mtbf: float
    model: TwoLevelPlan | None
    logs: str

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.modes)
