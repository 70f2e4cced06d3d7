"""Find this package's state dicts inside a ``StatefulDataLoader`` state, wherever torchdata put
them (the main snapshot, each worker's snapshot, the dataset state with ``num_workers=0``)."""

from __future__ import annotations

from typing import Any

from ..engine.untrusted_load import walk_state

__all__ = ["find_marked"]


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
