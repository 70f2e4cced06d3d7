"""One save at a time on a ``CheckpointWriter``: the claim a save takes in
``set_up_storage_writer`` and gives back when its part is over.

Why: one writer instance holds one save's state (the coordinator's assignment and pinned
layouts, the durable future); ``dcp.async_save`` runs saves on an executor thread, and a second
save that overlapped a running one on the same instance once lost a ``.metadata``. A save that
failed between the writer's calls (another rank's error, a planner error) never reaches a
release, so a claim whose thread is this one or has ended is taken over.
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import CheckpointError

__all__ = ["SaveClaim"]

#: How long a new save waits for the thread holding the claim to end before refusing: long
#: enough for an async executor thread whose save failed to exit, short for an overlap error.
STALE_CLAIM_WAIT_S = 2.0


class SaveClaim:
    """Which thread runs the save on one writer. Pickles as a free claim (no lock, no thread):
    ``dcp.async_save`` pickles the writer into another process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # claim and release race between a caller and an executor thread
        self._owner: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()

    def claim(self, uri: str) -> None:
        """Take the claim for the current thread.

        Raises:
            CheckpointError: another live thread holds it after :data:`STALE_CLAIM_WAIT_S`.
        """
        me = threading.current_thread()
        owner = self._owner
        if owner is not None and owner is not me:
            # A save that failed between the writer's calls never released its claim; when it
            # ran on dcp.async_save's executor thread, that thread exits just after the failure
            # reaches the caller's future, so a prompt retry can find it still alive.
            owner.join(STALE_CLAIM_WAIT_S)
        with self._lock:
            owner = self._owner
            if owner is not None and owner is not me and owner.is_alive():
                raise CheckpointError(
                    f"a save to {uri} is already running on this CheckpointWriter (thread {owner.name}); wait for "
                    "its future or use one writer per in-flight async_save",
                    path=uri,
                )
            # An owner that is this thread or dead belongs to a save that failed before it
            # could release: it is over.
            self._owner = me

    def release(self) -> None:
        """Give the claim back, if the current thread holds it."""
        with self._lock:
            if self._owner is threading.current_thread():
                self._owner = None
