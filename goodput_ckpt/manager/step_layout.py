"""The layout of a manager root: one checkpoint location per step, named ``step_{step:08d}``.

This is the one place that names step directories, so the ``CheckpointManager`` (which writes
them) and the tools (``ls``, ``inspect``) always agree. No torch here.

::

    ROOT/
      step_00001000/        a checkpoint location (goodput format: manifest.json + data files)
      step_00002000/
      anything-else/        ignored by the listing

Steps are non-negative integers. Names are zero-padded to 8 digits so they sort lexically in
step order up to 99,999,999; larger steps simply get more digits (``step_123456789``), and
:func:`parse_step_dir` accepts those, but only the canonical spelling of each step (so
``step_1`` and ``step_00000001`` cannot both claim step 1).
"""

from __future__ import annotations

import re

from ..errors import CheckpointError
from ..storage.base import Store, check_relative_name

__all__ = ["STEP_DIR_PREFIX", "child_uri", "list_step_dirs", "parse_step_dir", "step_dir_name"]

STEP_DIR_PREFIX = "step_"
_STEP_DIR = re.compile(r"step_(\d{8,})\Z")


def step_dir_name(step: int) -> str:
    """The directory name of ``step`` under a manager root (``1000`` -> ``"step_00001000"``).

    Raises:
        ValueError: ``step`` is not a non-negative integer.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a step must be a non-negative integer, got {step!r}")
    return f"{STEP_DIR_PREFIX}{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for, or ``None`` when it is not a step directory."""
    m = _STEP_DIR.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir_name(step) == name else None


def child_uri(root: str, name: str) -> str:
    """The URI of ``name`` inside ``root``: a local path, ``file://`` or ``s3://`` prefix alike."""
    root = str(root)
    base = root.rstrip("/")
    if not base:
        return f"/{name}" if root.startswith("/") else name
    return f"{base}/{name}"


def list_step_dirs(store: Store, skipped: list[str] | None = None) -> dict[int, list[str]]:
    """Step directories under the manager root ``store``, from one listing.

    A name in a step directory that is not a safe relative path (an S3 key such as
    ``step_00000005/../../x``, planted by hand or by another tool: the stores refuse to touch it)
    is left out, and appended to ``skipped`` when given. Why: a caller would otherwise try to
    delete or read it and fail on every call; retention stalled on such a key forever, keeping
    the step's other files (issue 33).

    Returns:
        step -> names of the files in that step directory, relative to it (sorted by step).
        A step directory without files does not appear (stores without directories cannot
        represent it).
    """
    steps: dict[int, list[str]] = {}
    for name in store.list():
        head, sep, rest = name.partition("/")
        if not sep:
            continue
        step = parse_step_dir(head)
        if step is None:
            continue
        try:
            check_relative_name(rest)
        except CheckpointError:
            if skipped is not None:
                skipped.append(name)
            continue
        steps.setdefault(step, []).append(rest)
    return dict(sorted(steps.items()))
