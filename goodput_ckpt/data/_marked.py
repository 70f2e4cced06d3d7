"""Find this package's state dicts inside a ``StatefulDataLoader`` state, wherever torchdata put
them (the main snapshot, each worker's snapshot, the dataset state with ``num_workers=0``), and
replace them in a copy (a save stores a rank's part of a state, :mod:`._sampler_state`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..engine.untrusted_load import MAX_STATE_DEPTH, walk_state

__all__ = ["find_marked", "replace_marked"]


def find_marked(state: Any, mark: str, what: str = "the dataloader state") -> list[dict]:
    """Every dict in the nested ``state`` that has the key ``mark`` (not looking inside those),
    in order. The state comes from a checkpoint: the walk is bounded (``walk_state``: each
    container once, no cycles, bounded nesting).

    Raises:
        CorruptCheckpointError: ``state`` contains itself or nests too deeply, naming ``what``.
    """

    def marked(x: Any) -> bool:
        return isinstance(x, dict) and x.get(mark) is not None

    walk = walk_state(state, what, key="dataloader", enter=lambda x: not marked(x))
    return [x for x in walk if marked(x)]


def replace_marked(state: Any, mark: str, new: Callable[[dict], Any]) -> Any:
    """A copy of the live ``state`` (a loader's own ``state_dict()``) in which every dict that has
    the key ``mark`` is ``new(that dict)``; the containers are copied (each once, shared ones
    stay shared), the leaves are not, and ``state`` itself is left as it is.

    Raises:
        ValueError: the state nests deeper than ``MAX_STATE_DEPTH`` (a restore would refuse it).
    """
    memo: dict[int, Any] = {}

    def copy(x: Any, depth: int) -> Any:
        if isinstance(x, dict) and x.get(mark) is not None:
            return new(x)
        if not isinstance(x, (dict, list, tuple)):
            return x
        if id(x) in memo:
            return memo[id(x)]
        if depth >= MAX_STATE_DEPTH:
            raise ValueError(f"the dataloader state nests deeper than {MAX_STATE_DEPTH} levels")
        if isinstance(x, dict):
            out: Any = {k: copy(v, depth + 1) for k, v in x.items()}
        else:
            out = type(x)(copy(v, depth + 1) for v in x) if type(x) in (list, tuple) else x
        memo[id(x)] = out
        return out

    return copy(state, 0)
