"""Nested state dicts in tests: an empty destination shaped like a state, and exact comparison."""

from __future__ import annotations

import torch

__all__ = ["assert_same", "zeros_like"]


def zeros_like(tree):
    """A destination for ``dcp.load`` shaped like ``tree``: zeroed tensors, empty plain values."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree, memory_format=torch.contiguous_format)
    if isinstance(tree, dict):
        return {k: zeros_like(v) for k, v in tree.items()}
    return type(tree)() if isinstance(tree, (int, float, str, list)) else None


def assert_same(got, want, path="") -> None:
    """Bit-exact equality of nested dicts of tensors and plain values (fp8 compared as bytes)."""
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        as_bytes = want.dtype.itemsize == 1
        assert torch.equal(got.view(torch.uint8) if as_bytes else got, want.view(torch.uint8) if as_bytes else want), path
    elif isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    else:
        assert got == want, path
