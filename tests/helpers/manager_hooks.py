"""The one place tests step inside a ``CheckpointManager``.

Some tests need what no user should arrange: a save thread held back so that a save stays in
flight with its copies pending, a fault injected into staging or the save thread, the manager's
staging buffers and pending copies read at a given instant. The manager keeps those parts
private (``_staging``, ``_saves``) because none of it is an API; the tests reach them only
through these functions, so a change of the manager's insides changes this module alone. Once
inside, they use the parts' public, documented members (``ReusableStager.buffers`` and
``nbytes``, ``StepGuard.pending``, ``DeferredCopies.done`` and ``confirmed``).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["hold_saves", "retention_of", "save_jobs_of", "staging_of"]


def staging_of(mgr: Any) -> Any:
    """The manager's ``AsyncStaging``: ``.stager`` (the reused buffers) and ``.guard`` (the
    copies the next optimizer step waits for, ``.guard.pending``)."""
    return mgr._staging


def save_jobs_of(mgr: Any) -> Any:
    """The manager's ``SaveJobs``: the save thread's ``write`` and ``report_failure``."""
    return mgr._saves


def retention_of(mgr: Any) -> Any:
    """The coordinator's ``BackgroundRetention`` of a manager without ``local_dir`` (``None`` on
    other ranks): ``pending()``, ``drain()``, ``runs``."""
    return mgr._chain.retention


def hold_saves(mgr: Any, timeout: float = 60.0) -> threading.Event:
    """Make the manager's save thread first wait for the returned event (or ``timeout``), so
    that the next async save stays in flight, its deferred copies pending, until ``set()``."""
    release = threading.Event()
    jobs = save_jobs_of(mgr)
    jobs._worker = ThreadPoolExecutor(1, thread_name_prefix="held-save")
    jobs._worker.submit(release.wait, timeout)
    return release
