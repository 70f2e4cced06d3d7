"""Integer mapping keys across a flattened state dict: found when reading, given back when nesting.

DCP's flattening writes every mapping key as a string, so an optimizer's ``state`` (keyed
by parameter index) would come back keyed ``'0'``, ``'1'`` and load without complaint into an
optimizer that then starts from fresh moments. Sources record the positions of integer keys
(:mod:`goodput_ckpt.format.nesting` defines the record and checks it when read from a file);
:func:`nest` rebuilds the nesting with them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import CheckpointError
from ...format.nesting import int_keys_problem

__all__ = ["find_int_keys", "nest", "renamed_int_keys"]


def find_int_keys(nested: Mapping[Any, Any], planner_data: Mapping[str, Sequence[Any]]) -> dict[str, list[int]]:
    """The ``int_keys`` record of ``nested`` flattened as ``planner_data`` says.

    Walks each flattened key's path through ``nested``; at a mapping, the path's string is
    matched back to the key it came from.

    Raises:
        CheckpointError: a mapping key that is neither ``str`` nor ``int`` (a ``bool``, a
            float, a tuple...): flattening turns it into a string that cannot be turned back.
    """
    originals: dict[int, dict[str, Any]] = {}  # id(mapping) -> str(key) -> key; ``nested`` keeps them alive
    out: dict[str, list[int]] = {}
    for flat_key, path in planner_data.items():
        obj: Any = nested
        for i, part in enumerate(path):
            if isinstance(obj, Mapping):
                keys = originals.get(id(obj))
                if keys is None:
                    keys = originals[id(obj)] = {}
                    for k in obj:
                        if type(k) not in (str, int):
                            where = ".".join(map(str, path[:i])) or "the top level"
                            raise CheckpointError(
                                f"{where} has the key {k!r:.40} of type {type(k).__name__}; "
                                "convert keeps mapping keys of type str and int only",
                                key=flat_key,
                            )
                        keys[str(k)] = k
                k = keys[part]
                if type(k) is int:
                    out.setdefault(flat_key, []).append(i)
                obj = obj[k]
            else:
                obj = obj[part]
    return out


def nest(
    flat: Mapping[str, Any], planner_data: Mapping[str, Sequence[Any]], int_keys: Mapping[str, Sequence[int]]
) -> dict[Any, Any]:
    """DCP's ``unflatten_state_dict`` with the integer mapping keys given back.

    The containers follow DCP's rule: an integer path element is a list index (the list grows
    to it), a string one a mapping key, an integer key when ``int_keys`` marks its position.
    ``planner_data`` and ``int_keys`` are checked first (``check_planner_data`` bounds the
    list indices).

    Raises:
        CheckpointError: ``int_keys`` does not fit ``planner_data`` (named).
    """
    why = int_keys_problem(dict(int_keys), planner_data)
    if why is not None:
        raise CheckpointError(f"the record of integer keys {why}")
    root: dict[Any, Any] = {}
    for flat_key, value in flat.items():
        path = planner_data[flat_key]
        ints = set(int_keys.get(flat_key, ()))
        parts = [int(p) if i in ints else p for i, p in enumerate(path)]
        container: Any = root
        for i in range(len(path)):
            last = i == len(path) - 1
            fresh: Any = None if last else ({} if type(path[i + 1]) is str else [])
            if type(path[i]) is int:  # a list index (DCP's rule)
                if not isinstance(container, list):
                    raise CheckpointError(
                        f"planner_data of {flat_key!r} uses a list index where a mapping is", key=flat_key
                    )
                container.extend([None] * (parts[i] + 1 - len(container)))
                if last:
                    container[parts[i]] = value
                elif container[parts[i]] is None:
                    container[parts[i]] = fresh
            else:
                if not isinstance(container, dict):
                    raise CheckpointError(f"planner_data of {flat_key!r} names a key where a list is", key=flat_key)
                if last:
                    container[parts[i]] = value
                else:
                    container.setdefault(parts[i], fresh)
            if not last:
                container = container[parts[i]]
    return root


def renamed_int_keys(
    int_keys: Mapping[str, Sequence[int]], names: Mapping[str, str], dropped_parts: Mapping[str, int]
) -> dict[str, list[int]]:
    """``int_keys`` of a selection: ``names`` maps new keys to source keys, ``dropped_parts`` the
    number of leading path elements removed from each new key's path (a stripped prefix)."""
    out: dict[str, list[int]] = {}
    for new, old in names.items():
        n = dropped_parts.get(new, 0)
        kept = [p - n for p in int_keys.get(old, ()) if p >= n]
        if kept:
            out[new] = kept
    return out
