"""Python's cyclic garbage collector paused while a commit record's objects are made in bulk.

Why: building, serializing and parsing a commit record make hundreds of thousands of small
objects (entries, tuples, dicts) that form no reference cycles. Every 700 allocations the
collector runs, and every hundredth run walks every tracked object of the process: in a trainer
that is the model, the optimizer and everything else alive, hundreds of thousands of objects or
more. On a simulated 70B training state at 1,024 ranks (330 k tracked objects in that process,
fewer than a real trainer's) the pause makes build 1.4x, serialize 2.6x and parse 1.6x faster
(``benchmarks/probe_gc_pause.py``; docs/scale.md has the runs). Nothing made here needs the
collector: reference counting frees all of it.

The pause is process-wide (:func:`gc.disable`), nests, and is safe across threads (a save
thread building a record while the main thread parses one): the collector comes back when the
last pause ends, and only if it was enabled when the first began. A process forked during a
pause (a dataloader worker started while a save thread builds a record) starts with no pause of
its own: the collector is on again in the child, as the parent had it. Code that turns the
collector off itself while a pause runs (a trainer's manual collection) has it turned back on
when the pause ends; turn it off before saving or restoring, or after.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the body with the cyclic collector off (see the module doc); it is restored after,
    also when the body raises."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def _after_fork_in_child() -> None:
    """The child of a fork has only the forking thread: the pauses of the parent's other
    threads will never end here, so none is held; the collector is as the parent had it."""
    global _lock, _depth
    _lock = threading.Lock()
    if _depth:
        _depth = 0
        if _was_enabled:
            gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
