"""The ``CheckpointManager`` layer: steps, retention, async saves and staging, resume, the timeline.

Modules, one concern each:

- :mod:`.checkpoint_manager`: the public class (argument checks, the order of the calls);
- :mod:`.save_job`: the background save job: one save thread, its failures and their reports;
- :mod:`.agreement`: cross-rank agreement (which step to restore, failing a step on every rank);
- :mod:`.config`: the checked options;
- :mod:`.retention`: which steps are complete and which to delete;
- :mod:`.step_layout`: step directory names under a root;
- :mod:`.timeline`: the per-save timeline records and their JSON lines;
- :mod:`.staging`: async staging (reused buffers, copies deferred past ``save``, the optimizer
  step guard, the writer that commits only good copies).

``step_layout``, ``retention`` and ``timeline`` import no torch (the tools read roots and
timelines without it), so the class is loaded on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointManager", "ManagerConfig"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointManager":
        from .checkpoint_manager import CheckpointManager

        return CheckpointManager
    if name == "ManagerConfig":
        from .config import ManagerConfig

        return ManagerConfig
    raise AttributeError(f"module 'goodput_ckpt.manager' has no attribute {name!r}")
