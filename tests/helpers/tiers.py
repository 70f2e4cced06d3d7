"""Where a two-tier manager's node-local steps lie: ``LOCAL_DIR/job-<id>/step_N`` (one
sub-directory per job, ``goodput_ckpt.manager.job``)."""

from __future__ import annotations

from pathlib import Path

from goodput_ckpt.manager.job import JOB_DIR_PREFIX

__all__ = ["job_dir"]


def job_dir(node_dir: Path) -> Path:
    """The one job's tier inside the node directory ``node_dir`` (a test writes one job there)."""
    found = [p for p in Path(node_dir).iterdir() if p.is_dir() and p.name.startswith(JOB_DIR_PREFIX)]
    assert len(found) == 1, f"{node_dir} holds {len(found)} job directories: {found}"
    return found[0]
