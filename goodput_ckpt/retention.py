"""The steps under a manager root: which are complete, which to delete, and deleting them.

No torch here: a root is a :class:`~goodput_ckpt.storage.Store` whose files are grouped into step
directories by :mod:`.layout`. A step is *complete* when its commit record (``manifest.json``)
exists, *incomplete* otherwise (a save that is running, failed or was interrupted).

Retention policy (:func:`retention_victims`), applied after the commit of step ``committed``
while no other save of the same job runs:

- complete steps other than the newest ``keep_last`` (by step number) go;
- incomplete steps older than ``committed`` go (failed or interrupted saves);
- never deleted: ``committed``, the newest complete step, incomplete steps newer than
  ``committed`` (they may be in the middle of being written).
"""

from __future__ import annotations

import logging

from .format.manifest import MANIFEST_NAME
from .layout import list_step_dirs, step_dir_name
from .storage.base import Store

__all__ = ["StepScan", "delete_step", "retention_victims", "scan_steps"]

logger = logging.getLogger("goodput_ckpt.retention")


class StepScan:
    """One listing of a root: step -> its files, split into complete and incomplete steps."""

    def __init__(self, files: dict[int, list[str]]) -> None:
        self.files = files
        self.complete = [s for s, f in files.items() if MANIFEST_NAME in f]
        self.incomplete = [s for s, f in files.items() if MANIFEST_NAME not in f]

    @property
    def latest(self) -> int | None:
        return self.complete[-1] if self.complete else None


def scan_steps(root: Store) -> StepScan:
    """List ``root`` once (steps ascending)."""
    return StepScan(list_step_dirs(root))


def retention_victims(scan: StepScan, *, committed: int, keep_last: int | None) -> list[int]:
    """The steps to delete after ``committed`` was committed (see the module doc), ascending."""
    doomed = [s for s in scan.incomplete if s < committed]
    if keep_last is not None and scan.complete:
        keep = set(scan.complete[-keep_last:]) | {committed, scan.complete[-1]}
        doomed += [s for s in scan.complete if s not in keep]
    return sorted(doomed)


def delete_step(root: Store, step: int, files: list[str]) -> None:
    """Delete the checkpoint of ``step``: the commit record first, so that an interrupted deletion
    leaves an incomplete checkpoint (ignored, cleaned up later), never a manifest that points at
    missing files."""
    name = step_dir_name(step)
    for f in sorted(files, key=lambda f: f != MANIFEST_NAME):
        root.delete(f"{name}/{f}")
    logger.info("deleted the checkpoint of step %d under %s", step, root.uri)
