"""The upload markers of a staged volume: how the coordinator learns that other ranks' files are there.

After uploading a file, a rank writes a marker ``<file>.uploaded`` next to it on the volume. The
marker holds the file's size in ASCII, so it is never empty: ``rclone mount`` without a cache
uploads a file that got no write only when the kernel releases it, after ``close`` has returned,
so a deletion right after could precede the upload and leave the marker behind for good (seen in
CI); and a strict mount lists a file while its upload runs, so an empty marker is one still being
written. A marker is written only after its file was closed (and fsynced) on the volume, so a
commit record published after every marker is seen never precedes data.

The coordinator's commit waits for the markers of the files other ranks wrote
(:func:`wait_for_markers`), writes the record, then deletes them (:func:`delete_markers`). Both
poll the volume with one back-off loop (:func:`poll`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..errors import CheckpointError

if TYPE_CHECKING:
    from .volume import VolumeStore

__all__ = ["MARKER_SUFFIX", "delete_markers", "poll", "wait_for_markers", "write_marker"]

#: Suffix of the marker a rank writes on the volume once one of its files is there.
MARKER_SUFFIX = ".uploaded"
#: Polling: first and largest pause between two checks (a mount answers listings slowly under
#: upload load; a commit waits for the slowest rank, so a second of delay is negligible).
_POLL_FIRST_S, _POLL_MAX_S = 0.05, 1.0
#: How long the commit keeps deleting markers that are still listed after their deletion.
MARKER_DELETE_S = 10.0

_log = logging.getLogger("goodput_ckpt.storage.staged")


def poll(done: Callable[[], bool], *, deadline: float) -> bool:
    """Call ``done`` until it returns True (then True) or ``deadline`` (``time.monotonic``) has
    passed (then False), pausing between calls, each pause twice the last, up to a second."""
    pause = _POLL_FIRST_S
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(_POLL_MAX_S, pause * 2)
    return True


def write_marker(volume: VolumeStore, name: str, size: int) -> None:
    """Say on the volume that ``name`` (``size`` bytes) is uploaded, closed and fsynced."""
    marker = volume.open_sink(name + MARKER_SUFFIX)
    try:
        marker.write_at(0, [str(size).encode()])
        marker.close()
    except BaseException:
        marker.abort()
        raise


def wait_for_markers(volume: VolumeStore, files: Sequence[str], *, deadline: float, timeout_s: float) -> None:
    """Wait until every one of ``files`` has its (non-empty) marker on ``volume``.

    Raises:
        CheckpointError: some are still missing at ``deadline`` (``timeout_s`` is for the message).
    """
    waiting = list(files)

    def arrived() -> bool:
        waiting[:] = [f for f in waiting if not volume.size(f + MARKER_SUFFIX)]
        return not waiting

    if not poll(arrived, deadline=deadline):
        raise CheckpointError(
            f"{volume.uri}: {len(waiting)} data file(s) of other ranks were not uploaded within "
            f"{timeout_s:.0f}s (first: {', '.join(waiting[:3])}); the checkpoint was "
            "not committed on the volume. Check those ranks' durable_future() errors.",
            path=volume.uri,
        )


def delete_markers(volume: VolumeStore, files: Sequence[str]) -> None:
    """Delete the markers of ``files`` and check that they are gone.

    The checkpoint is committed by now, so a marker that outlives its deletion (a mount's
    listing lagging behind, or an upload finishing after the unlink) is only clutter: it is
    deleted again for :data:`MARKER_DELETE_S`, then left with a warning.
    """
    markers = [f + MARKER_SUFFIX for f in files]

    def gone() -> bool:
        for m in markers:
            volume.delete(m)
        markers[:] = [m for m in markers if volume.size(m) is not None]
        return not markers

    if not poll(gone, deadline=time.monotonic() + MARKER_DELETE_S):
        _log.warning(
            "%s: %d upload marker(s) are still listed after their deletion (first: %s); "
            "the checkpoint is committed, the markers can be deleted by hand",
            volume.uri,
            len(markers),
            markers[0],
        )
