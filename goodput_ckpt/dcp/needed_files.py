"""Which hash chunks of which data files a rank's load reads: the load plan, mapped through the
manifest.

A two-tier restore makes sure those chunks (and only those) are intact on the rank's node before
the load starts, so it runs the manager's load planner on the destination state dict, exactly as
``dcp.load`` will, and collects the chunks its read items fall in. Planning is local: no
collective, no byte read.
"""

from __future__ import annotations

from typing import Any

from ..format.dcp_metadata import StoredRange, to_dcp_metadata
from ..format.manifest import Manifest
from .load_planner import GridLoadPlanner

__all__ = ["chunks_read_by"]


def chunks_read_by(dest: dict[str, Any], manifest: Manifest) -> dict[str, set[int]]:
    """The hash chunks of each data file that loading into ``dest`` reads: file name -> chunk
    indices (a read verifies whole chunks, so these are the bytes the load depends on)."""
    metadata = to_dcp_metadata(manifest)
    planner = GridLoadPlanner()  # the planner the manager's dcp.load uses
    planner.set_up_planner(dest, metadata=metadata, is_coordinator=False)
    plan = planner.finish_plan(planner.create_local_plan())  # as dcp.load: the items stay local
    storage = metadata.storage_data or {}
    size = manifest.chunk_size
    chunks: dict[str, set[int]] = {}
    for item in plan.items:
        where = storage.get(item.storage_index)
        if isinstance(where, StoredRange):
            last = max(where.offset, where.offset + where.length - 1)
            chunks.setdefault(where.file, set()).update(range(where.offset // size, last // size + 1))
    return chunks
