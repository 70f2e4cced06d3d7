"""Find this package's state dicts inside a ``StatefulDataLoader`` state, wherever torchdata put
them (the main snapshot, each worker's snapshot, the dataset state with ``num_workers=0``)."""

from __future__ import annotations

from typing import Any

__all__ = ["find_marked"]


def find_marked(state: Any, mark: str) -> list[dict]:
    """Every dict in the nested ``state`` that has the key ``mark`` (not looking inside those)."""
    found: list[dict] = []
    stack = [state]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if x.get(mark) is not None:
                found.append(x)
            else:
                stack.extend(reversed(list(x.values())))
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
    return found
