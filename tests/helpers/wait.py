"""The one way a test waits for something another thread or process does: poll a real condition
under a deadline. A fixed sleep is never evidence (it passes on a fast machine and fails on a slow
one, or worse, passes when the thing under test never happened)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_until"]

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 60.0, *, interval: float = 0.005, what: str = "") -> T:
    """Call ``predicate`` until it returns something truthy, and return that.

    Args:
        predicate: a cheap check of a real condition (a file exists, a counter moved ...).
        timeout: seconds before giving up; generous, since it only bounds a failing test.
        interval: seconds between calls.
        what: words for the failure message (defaults to the predicate's name).

    Raises:
        TimeoutError: the condition did not hold within ``timeout``; a test failure, not a hang.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            name = what or getattr(predicate, "__name__", repr(predicate))
            raise TimeoutError(f"waited {timeout:g} s for {name}, in vain")
        time.sleep(interval)
