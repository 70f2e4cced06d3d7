"""Property-style tests: one test case that checks a property for many random seeds.

A seed per parametrized case inflated the suite's count by hundreds of cheap cases; one case
that loops keeps the coverage, and its failure names the seed, so that the failing input can be
rebuilt alone (``check(seed)``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest

__all__ = ["for_each_seed"]


def for_each_seed(seeds: Iterable[int], check: Callable[[int], object]) -> None:
    """Call ``check(seed)`` for every seed, in order, and stop at the first failure.

    Raises:
        AssertionError: ``check`` failed (an assertion, ``pytest.raises`` or another error) for a
            seed; the message starts with ``seed N:`` and the original failure is its cause.
    """
    for seed in seeds:
        try:
            check(seed)
        except (Exception, pytest.fail.Exception) as e:
            raise AssertionError(f"seed {seed}: {type(e).__name__}: {e}") from e
