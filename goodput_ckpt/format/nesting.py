"""The record of which state-dict keys were integers: ``dcp.int_keys`` (docs/format.md).

Why it exists: DCP flattens a nested state dict into dotted keys and records each key's path
(``planner_data``), writing every mapping key as a string (``str(k)``) and keeping integers
only for list indices. An optimizer's ``state`` is keyed by parameter index (``{0: {...},
1: {...}}``), so a ``torch.save`` file converted into a checkpoint and back would come back
keyed ``'0'``, ``'1'``: ``optimizer.load_state_dict`` accepts that silently and the next step
starts with fresh moments. ``int_keys`` names, for each flattened key, the positions of its
path that were integer mapping keys, so a writer that rebuilds the nesting (``convert --to
torch``) gives the original keys back.

Shape: ``{flat key: [position, ...]}``, every flat key one of ``planner_data``'s, every
position an index into that key's path whose element is a string spelling an integer in
canonical form (``"0"``, ``"-3"``, never ``"007"`` or ``"+1"``). Absent or empty when every
mapping key was a string. No torch here: the manifest parser checks it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["int_keys_problem", "is_int_spelling"]

#: Integers in canonical decimal form, at most 19 digits (an int64, what torch code uses as
#: keys): bounds what ``int()`` parses from a file.
_INT_SPELLING = re.compile(r"-?(0|[1-9][0-9]{0,18})")


def is_int_spelling(text: object) -> bool:
    """Whether ``text`` is a string that ``str(int(text)) == text`` holds for (bounded length)."""
    return isinstance(text, str) and _INT_SPELLING.fullmatch(text) is not None and text != "-0"


def int_keys_problem(int_keys: object, planner_data: Mapping[str, Any] | None) -> str | None:
    """What is wrong with an ``int_keys`` record read from a file, or ``None``.

    Every entry must name a flattened key of ``planner_data`` and list distinct positions of
    that key's path (in increasing order) whose elements spell integers; so the record is never
    larger than ``planner_data`` itself, and checking it is linear in its size.
    """
    if int_keys is None:
        return None
    if not isinstance(int_keys, dict):
        return f"must be an object, not {type(int_keys).__name__}"
    if int_keys and not isinstance(planner_data, Mapping):
        return "is given without planner_data"
    for key, positions in int_keys.items():
        path = planner_data.get(key) if isinstance(planner_data, Mapping) else None
        if not isinstance(path, (list, tuple)):
            return f"names {key!r:.80}, which has no planner_data path"
        if not isinstance(positions, list) or not 1 <= len(positions) <= len(path):
            return f"for {key!r:.80} must be a list of 1 to {len(path)} path positions"
        last = -1
        for p in positions:
            if isinstance(p, bool) or not isinstance(p, int) or not last < p < len(path):
                return f"for {key!r:.80} holds {p!r:.40}: positions must increase and lie below {len(path)}"
            if not is_int_spelling(path[p]):
                return f"for {key!r:.80} marks path element {path[p]!r:.40}, which does not spell an integer"
            last = p
    return None
