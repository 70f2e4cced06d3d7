"""Part of a checkpoint, renamed: what ``convert --model-only`` / ``--keys`` / ``--strip-prefix`` export.

Why: a ``CheckpointManager`` checkpoint holds the whole training state under sections
(``model.``, ``optimizer.``, ``rng.``, ``dataloader.``, ...). A Hugging Face model directory
holds only the model, under the model's own names, with tied weights written once. A
:class:`SelectedSource` presents that view of any source without copying: it filters and
renames keys, drops aliases of tied weights, and reads through to the wrapped source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from fnmatch import fnmatchcase
from typing import Any

from ...errors import CheckpointError
from .base import Box, Source
from .key_types import renamed_int_keys

__all__ = ["SelectedSource"]


class SelectedSource(Source):
    """The keys of ``source`` that match one of ``patterns`` (``fnmatch``, case-sensitive),
    with ``strip_prefix`` removed from their names and the keys in ``drop`` left out.

    Raises:
        CheckpointError: nothing matches, or two keys get the same name after stripping.
    """

    def __init__(
        self, source: Source, patterns: Sequence[str], strip_prefix: str | None, drop: Sequence[str] = ()
    ) -> None:
        super().__init__()
        self.format = source.format
        self.uri = source.uri
        self.world_size = source.world_size
        self._source = source
        self._names: dict[str, str] = {}  # new key -> source key
        dropped = set(drop)
        for key, meta in source.items.items():
            if key in dropped or not any(fnmatchcase(key, p) for p in patterns):
                continue
            new = key[len(strip_prefix) :] if strip_prefix and key.startswith(strip_prefix) else key
            if not new or new in self._names:
                raise CheckpointError(
                    f"{source.uri}: stripping {strip_prefix!r} from {key!r} gives a key that is empty or already taken"
                )
            self._names[new] = key
            self.items[new] = replace(meta, key=new)
        if not self._names:
            raise CheckpointError(
                f"{source.uri}: no key matches {', '.join(patterns)}; see `goodput-ckpt inspect` for its keys"
            )
        self.planner_data = _renamed_paths(source.planner_data, self._names, strip_prefix)
        if self.planner_data is not None and source.planner_data is not None:
            dropped_parts = {
                new: len(source.planner_data[old]) - len(self.planner_data[new]) for new, old in self._names.items()
            }
            self.int_keys = renamed_int_keys(source.int_keys, self._names, dropped_parts)
        self.metadata = {k: v for k, v in source.metadata.items() if k != "training_state"}

    def boxes(self, key: str) -> Sequence[Box]:
        return self._source.boxes(self._names[key])

    def object_bytes(self, key: str) -> bytes:
        return self._source.object_bytes(self._names[key])

    def object_value(self, key: str) -> Any:
        return self._source.object_value(self._names[key])

    def close(self) -> None:
        self._source.close()


def _renamed_paths(
    planner_data: dict[str, list[Any]] | None, names: dict[str, str], strip: str | None
) -> dict[str, list[Any]] | None:
    """The nested-state-dict paths of the selected keys, with the stripped components removed.

    ``None`` (a flat output) when a stripped prefix does not end at a path component.
    """
    if planner_data is None:
        return None
    out: dict[str, list[Any]] = {}
    for new, old in names.items():
        path = planner_data.get(old)
        if path is None:
            return None
        if new != old:
            n = next((i for i in range(1, len(path) + 1) if ".".join(map(str, path[:i])) + "." == strip), None)
            if n is None:
                return None
            path = path[n:]
        out[new] = list(path)
    return out
