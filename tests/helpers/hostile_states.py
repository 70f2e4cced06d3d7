"""Hostile values a saved loader state may hold (issue 33), shared by tests/data and tests/state."""

from __future__ import annotations

import io
import zipfile
from typing import Any

import torch

__all__ = ["cyclic", "deflated", "saved"]


def cyclic() -> list:
    """A list that contains itself: ``torch.load(weights_only=True)`` rebuilds it."""
    x: list = [1, 2]
    x.append(x)
    return x


def saved(value: Any) -> bytes:
    """``torch.save(value)``'s bytes."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def deflated(value: Any) -> bytes:
    """``torch.save(value)`` with every entry re-compressed: torch.load still reads it."""
    src = zipfile.ZipFile(io.BytesIO(saved(value)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info.filename))
    return out.getvalue()
