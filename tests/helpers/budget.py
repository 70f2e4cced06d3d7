"""Bounded work, counted instead of timed (TESTING.md: no timed assertions).

- :func:`counted_calls`: run a function with a budget of Python and builtin calls (``sys.setprofile``
  events), so an unbounded walk fails the test with :class:`OverBudget` instead of hanging it.
- :class:`TorchWork`: the elements torch ops produce while it is active (a dispatch mode), so a
  check that materializes a stride-0 view shows up as the gigabytes it would cost.
- :func:`python_peak`: the peak of Python-allocator memory (tracemalloc) while a function runs.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OverBudget", "TorchWork", "counted_calls", "python_peak"]


class OverBudget(Exception):
    """More calls than the budget allowed (the work was unbounded, or above its stated bound)."""


def counted_calls(fn: Callable[[], Any], limit: int) -> tuple[Any, int]:
    """``(fn(), calls)``; raises :class:`OverBudget` as soon as ``fn`` makes more than ``limit``
    Python or builtin calls. Exceptions ``fn`` raises pass through (the budget is in force up to
    them)."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1
            if calls > limit:
                raise OverBudget(f"more than {limit} calls")

    sys.setprofile(profile)
    try:
        return fn(), calls
    finally:
        sys.setprofile(None)


class TorchWork(TorchDispatchMode):
    """Counts the torch ops run while active and the elements of every tensor they return."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.elements += t.numel()
        return out


def python_peak(fn: Callable[[], Any]) -> tuple[Any, int, BaseException | None]:
    """``(result or None, peak bytes, the exception fn raised or None)``: the peak of memory
    allocated through Python's allocator while ``fn`` ran (strings, bytes, lists; not torch
    storages)."""
    gc.collect()
    tracemalloc.start()
    err: BaseException | None = None
    out = None
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - handed back to the test, which asserts on it
        err = e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return out, peak, err
