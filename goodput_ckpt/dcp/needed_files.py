"""Which data files a rank's load reads: DCP's own load plan, mapped through the manifest.

A two-tier restore makes sure those files (and only those) are intact on the rank's node before
the load starts, so it runs the manager's load planner on the destination state dict, exactly as
``dcp.load`` will, and collects the files its read items point at. Planning is local: no
collective, no byte read.
"""

from __future__ import annotations

from typing import Any

from ..format.dcp_metadata import StoredRange, to_dcp_metadata
from ..format.manifest import Manifest
from .load_planner import GridLoadPlanner

__all__ = ["files_read_by"]


def files_read_by(dest: dict[str, Any], manifest: Manifest) -> set[str]:
    """The data files of ``manifest`` that loading into ``dest`` reads (names as listed)."""
    metadata = to_dcp_metadata(manifest)
    planner = GridLoadPlanner()  # the planner the manager's dcp.load uses
    planner.set_up_planner(dest, metadata=metadata, is_coordinator=False)
    plan = planner.finish_plan(planner.create_local_plan())  # as dcp.load: the items stay local
    storage = metadata.storage_data or {}
    files = set()
    for item in plan.items:
        where = storage.get(item.storage_index)
        if isinstance(where, StoredRange):
            files.add(where.file)
    return files
