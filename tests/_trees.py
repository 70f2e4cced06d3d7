"""Nested state dicts in tests: an empty destination shaped like a state, and exact comparison.

One implementation for every test folder (tests/ is on ``sys.path`` through tests/conftest.py).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["assert_tree_equal", "same_tensor", "zeros_like"]


def zeros_like(tree: Any) -> Any:
    """A destination for ``dcp.load`` shaped like ``tree``: zeroed tensors and *blank* plain
    values (``0``, ``""``, ``[]``, ``None``), so a load must restore those too."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree, memory_format=torch.contiguous_format)
    if isinstance(tree, dict):
        return {k: zeros_like(v) for k, v in tree.items()}
    return type(tree)() if isinstance(tree, (int, float, str, list)) else None


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (dtype, shape and bytes), for every dtype including fp8 and bool."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_tree_equal(got: Any, want: Any, path: str = "") -> None:
    """Bit-exact equality of nested dicts, lists and tuples of tensors, NumPy arrays and plain
    values; the message names the first path that differs."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and same_tensor(got, want), f"{path}: {got!r} != {want!r}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_tree_equal(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_tree_equal(g, w, f"{path}.{i}")
    elif type(want).__module__ == "numpy" and hasattr(want, "shape"):
        import numpy as np

        assert np.array_equal(got, want), f"{path} differs"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"
