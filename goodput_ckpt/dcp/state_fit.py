"""Whether a state dict can take a checkpoint, said in one line before anything is read.

Why: when the destination does not fit (a model of another shape, an SGD optimizer where AdamW
was saved), torch's planner raises ``ValueError("Size mismatch ...")`` or ``RuntimeError("Missing
key ...")`` inside ``dcp.load``, which wraps it in a ``CheckpointException`` whose text is a
60-line traceback with the cause on its last line. :func:`check_fit` compares the flattened
destination with the saved metadata first and raises a :class:`CheckpointError` whose message is
the cause: the key, the saved shape and dtype and the destination's, and for an optimizer the
state names and options that differ. :class:`~.load_planner.GridLoadPlanner` calls it, so
``CheckpointManager.restore`` and ``dcp.load(..., planner=GridLoadPlanner())`` both report it.

Not an error here, as in torch: a dtype that differs with the shape equal (DCP casts while
copying), and saved keys the destination does not ask for (a partial load).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointError

__all__ = ["check_fit"]

#: Problems named in full in the message; the rest are counted.
SHOWN = 3
#: An optimizer section: ``<prefix>state.<param>.<name>`` and ``<prefix>param_groups.<i>.<option>``.
_OPTIM = re.compile(r"^((?:.*\.)?)(state|param_groups)\.(.+)\.([^.]+)$")


def _shape(size: Any) -> str:
    return "(" + ", ".join(str(int(s)) for s in size) + ("," if len(size) == 1 else "") + ")"


def _dtype(t: Any) -> str:
    return str(t).removeprefix("torch.")


def check_fit(local: Mapping[str, Any], saved: Mapping[str, Any], *, strict: bool = True) -> None:
    """Raise if the flattened destination ``local`` cannot take the saved items ``saved``
    (DCP's ``state_dict_metadata``); ``strict``: every local key must be saved.

    Raises:
        CheckpointError: the first line names the cause; ``key`` lists the keys involved.
    """
    problems: list[str] = []
    keys: list[str] = []
    missing = [k for k in local if k not in saved] if strict else []
    for fqn, obj in local.items():
        md = saved.get(fqn)
        if md is None:
            continue
        size = getattr(obj, "size", None)
        local_size = size() if callable(size) and not isinstance(obj, (int, float)) else None
        if isinstance(md, TensorStorageMetadata):
            if local_size is None:
                problems.append(
                    f"{fqn}: saved as a {_dtype(md.properties.dtype)} tensor {_shape(md.size)}, here a {type(obj).__name__}"
                )
                keys.append(fqn)
            elif tuple(md.size) != tuple(local_size):
                here = f"{_dtype(obj.dtype)} {_shape(local_size)}" if hasattr(obj, "dtype") else _shape(local_size)
                problems.append(
                    f"{fqn}: saved {_dtype(md.properties.dtype)} {_shape(md.size)}, this state dict's {here}"
                )
                keys.append(fqn)
    optim = _optimizer_difference(missing, local, saved)
    if optim is not None:
        text, involved = optim
        problems.insert(0, text)
        keys = involved + keys
        missing = [k for k in missing if k not in set(involved)]
    if missing:
        shown = ", ".join(missing[:SHOWN]) + (f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else "")
        problems.append(f"the checkpoint has no {shown} ({len(missing)} key(s) this state dict expects)")
        keys += missing
    if not problems:
        return
    more = f" (and {len(problems) - SHOWN} more mismatches)" if len(problems) > SHOWN else ""
    raise CheckpointError(
        "the state dict does not fit the checkpoint: " + "; ".join(problems[:SHOWN]) + more, key=", ".join(keys[:64])
    )


def _names(keys: Any, prefix: str) -> tuple[set[str], set[str]]:
    """State names and param-group options of the optimizer section ``prefix``."""
    state, options = set(), set()
    for k in keys:
        m = _OPTIM.match(k)
        if m is not None and m.group(1) == prefix:
            (state if m.group(2) == "state" else options).add(m.group(4))
    return state, options


def _optimizer_difference(
    missing: list[str], local: Mapping[str, Any], saved: Mapping[str, Any]
) -> tuple[str, list[str]] | None:
    """For missing keys in an optimizer section (one the checkpoint also has): which state
    names and options differ, and the missing keys it explains; ``None`` when none is."""
    prefixes = []
    for k in missing:
        m = _OPTIM.match(k)
        if (
            m is not None
            and m.group(1) not in prefixes
            and any(s.startswith(m.group(1) + "param_groups.") for s in saved)
        ):
            prefixes.append(m.group(1))
    if not prefixes:
        return None
    prefix = prefixes[0]
    local_state, local_opts = _names(local, prefix)
    saved_state, saved_opts = _names(saved, prefix)
    parts = []
    if local_state != saved_state:
        parts.append(
            f"its state holds {', '.join(sorted(local_state)) or 'nothing'}, the saved state "
            f"{', '.join(sorted(saved_state)) or 'nothing'}"
        )
    if local_opts - saved_opts:
        parts.append(f"its param_groups have {', '.join(sorted(local_opts - saved_opts))}, which the saved ones lack")
        if saved_opts - local_opts:
            parts.append(f"the saved ones have {', '.join(sorted(saved_opts - local_opts))}")
    if not parts:
        return None
    where = f"the optimizer at {prefix}*" if prefix else "the optimizer"
    involved = [k for k in missing if (m := _OPTIM.match(k)) is not None and m.group(1) == prefix]
    return f"{where} is not the kind that was saved ({'; '.join(parts)})", involved
