"""Checks of ``CheckpointWriter``'s arguments (``dcp/writer.py``), kept out of the module that
holds DCP's call order."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["json_checked", "positive"]


def positive(name: str, value: int | None, default: int) -> int:
    """``value``, or ``default`` when it is ``None``.

    Raises:
        ValueError: ``value`` is not a positive integer.
    """
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def json_checked(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON round trip of ``meta`` (user metadata for the manifest).

    Raises:
        ValueError: ``meta`` is not JSON-serializable (or holds NaN or infinities).
    """
    try:
        return json.loads(json.dumps(dict(meta), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"metadata must be JSON-serializable: {e}") from e
