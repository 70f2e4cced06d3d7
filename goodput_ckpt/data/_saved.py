"""Checks for values this package reads back from a checkpoint's loader state.

Why strict: a saved count drives a slice, a loop or a seed. ``int()`` would take ``1.5``,
``True`` and ``"7"``, and raise ``OverflowError`` on ``float('inf')``; a negative count becomes
a slice end that silently drops data; a tensor may be a stride-0 view whose few stored bytes
stand for gigabytes. Every saved value is therefore an exact type in its real range before it
is used, and the callers name the rank's row and the field when it is not.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["saved_int", "saved_tensor"]


def saved_int(value: Any, lo: int, hi: int, field: str) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) in ``[lo, hi]``.

    Raises:
        ValueError: naming ``field``, otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{field} = {value!r:.40} is not an integer in [{lo}, {hi}]")
    return value


def saved_tensor(value: Any, dtype: torch.dtype, numel: int, field: str) -> torch.Tensor:
    """``value`` if it is a dense, contiguous, one-dimensional CPU tensor of ``dtype`` with
    exactly ``numel`` elements (so its memory is what its size says, not a stride-0 view).

    Raises:
        ValueError: naming ``field``, otherwise.
    """
    ok = (
        isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and value.device.type == "cpu"
        and value.dtype == dtype
        and value.dim() == 1
        and value.numel() == numel
        and value.is_contiguous()
    )
    if not ok:
        got = (
            f"{value.dtype} {tuple(value.shape)} (strides {value.stride() if value.layout == torch.strided else value.layout})"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise ValueError(f"{field} must be a contiguous {dtype} tensor of {numel} element(s), got {got}")
    return value
