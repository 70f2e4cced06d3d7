"""What a :class:`~goodput_ckpt.CheckpointManager` tells about its job without changing anything:
the job's id, the steps complete on each tier, where a step lives, a step's ``extra``, the save
in flight, the last background failure and the timeline.

Why a module of its own: these read-only views are a third of the manager's public surface
and none of its logic; the class itself (``checkpoint_manager.py``) keeps the save, the restore
and the lifecycle. :class:`ManagerQueries` is a base of ``CheckpointManager`` and reads only
the attributes its ``__init__`` sets (``root_uri``, ``_job``, ``_saves``, ``_timeline``,
``_topology``, ``_chain``).
"""

from __future__ import annotations

from typing import Any

from ..engine.manifest_load import load_manifest
from ..errors import CheckpointError
from ..state import EXTRA_KEY, Topology
from .chain import Chain
from .job import JobState
from .save_job import SaveJobs
from .step_layout import child_uri, step_dir_name
from .timeline import TimelineSink

__all__ = ["ManagerQueries"]


class ManagerQueries:
    """The read-only views of a :class:`~goodput_ckpt.CheckpointManager` (see the module doc)."""

    root_uri: str
    _job: JobState
    _saves: SaveJobs
    _timeline: TimelineSink
    _topology: Topology
    _chain: Chain

    @property
    def job_id(self) -> str:
        """The id of the job whose checkpoints this manager saves and restores (:mod:`.job`):
        the one recorded at the root, or a new one that the first save records there."""
        return self._job.id

    @property
    def last_error(self) -> CheckpointError | None:
        """The most recent failure of a background save, or ``None``."""
        return self._saves.last_error

    @property
    def timeline(self) -> list[dict[str, Any]]:
        """This rank's newest timeline records (see :mod:`goodput_ckpt.manager.timeline`), oldest first."""
        return list(self._timeline.records)

    @property
    def timeline_path(self) -> str | None:
        """The JSON-lines file the timeline is appended to, or ``None``."""
        return self._timeline.path

    @property
    def is_coordinator(self) -> bool:
        """Whether this rank deletes old checkpoints and decides which step to restore."""
        return self._topology.rank == 0

    @property
    def in_flight_step(self) -> int | None:
        """The step an async save is still writing (or applying retention after), or ``None``."""
        return self._saves.in_flight_step

    def steps(self) -> list[int]:
        """The steps that hold a complete (committed) checkpoint, ascending. With two tiers: the
        steps this rank sees committed on its node's local tier or on the persistent tier
        (:meth:`step_tiers` says which)."""
        return list(self._chain.step_tiers())

    def step_tiers(self) -> dict[int, tuple[str, ...]]:
        """Step -> the tiers holding a committed copy of it, seen from this rank (``"local"``:
        this node's directory, ``"persistent"``: the root). One tier: every step is persistent."""
        return self._chain.step_tiers()

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None``."""
        steps = self.steps()
        return steps[-1] if steps else None

    def step_uri(self, step: int) -> str:
        """Where the checkpoint of ``step`` lives (for ``CheckpointReader`` or the tools): on the
        persistent tier (with two tiers, only persisted steps are complete there)."""
        return child_uri(self.root_uri, step_dir_name(step))

    def extra(self, step: int) -> dict[str, Any]:
        """The ``extra`` metadata saved with ``step``.

        Raises:
            CheckpointNotFoundError / IncompleteCheckpointError / CorruptCheckpointError.
        """
        manifest = load_manifest(self._chain.manifest_store(step))
        extra = manifest.metadata.get(EXTRA_KEY, {})
        return dict(extra) if isinstance(extra, dict) else {}
