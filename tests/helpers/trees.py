"""State dicts in tests: the state most tests save, an empty destination shaped like a state, and
exact comparison. One implementation for every test folder."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["assert_tree_equal", "make_state", "same_tensor", "zeros_like"]


def make_state(seed: int = 0, *, numel: int = 5000, awkward: bool = False) -> dict[str, Any]:
    """The state most tests save: flat keys, several dtypes, one plain value.

    ``w`` (float32, ``numel`` elements: the size knob, pick it to span chunks, parts or files),
    ``b`` (int64 beyond 32 bits, 3x5), ``h`` (bfloat16, 40x7) and ``step`` (``seed``, a plain
    value, so an object item). Different seeds give different values, same seed the same.

    ``awkward=True`` adds what breaks naive writers and readers: float16, bool and uint8 of odd
    lengths, a 0-d and an empty tensor, a non-contiguous view, float8 where torch has it, forty
    small tensors (many items) and a nested dict of plain values.
    """
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, Any] = {
        "w": torch.randn(numel, generator=g),
        "b": torch.randint(-(2**40), 2**40, (3, 5), generator=g),
        "h": torch.randn(40, 7, generator=g).to(torch.bfloat16),
        "step": seed,
    }
    if awkward:
        sd.update(
            {
                "half": torch.randn(1001, generator=g).half(),
                "flag": torch.rand(33, generator=g) > 0.5,
                "u8": torch.randint(0, 255, (513,), generator=g, dtype=torch.uint8),
                "scalar": torch.tensor(1.5 + seed),
                "empty": torch.empty(0, 3),
                "view": torch.randn(64, 48, generator=g).t(),  # non-contiguous
                "small": {f"n{i}": torch.randn(17 + i, generator=g) for i in range(40)},
                "extra": {"name": f"run-{seed}", "lr": 0.001, "betas": [0.9, 0.95]},
            }
        )
        if hasattr(torch, "float8_e4m3fn"):
            sd["fp8"] = torch.randn(257, generator=g).to(torch.float8_e4m3fn)
    return sd


def zeros_like(tree: Any) -> Any:
    """A destination for ``dcp.load`` shaped like ``tree`` that holds none of its values.

    Tensors become zeros (contiguous); plain values become blanks (``0``, ``""``, ``False``,
    ``[]``, ``None``), so a load must restore objects as well as tensors, and a reader that skips
    them fails the comparison. Dicts, and the lists DCP walks into (:func:`_walked`), keep
    their shape.
    """
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree, memory_format=torch.contiguous_format)
    if isinstance(tree, dict):
        return {k: zeros_like(v) for k, v in tree.items()}
    if _walked(tree):
        return [zeros_like(v) for v in tree]
    return type(tree)() if isinstance(tree, (bool, int, float, str, list)) else None


def _walked(value: Any) -> bool:
    """Whether DCP's traversal walks into ``value`` rather than storing it whole as an object: a
    list holding a tensor, a dict or such a list (torch's ``traverse_state_dict``)."""
    return isinstance(value, list) and any(isinstance(v, (torch.Tensor, dict)) or _walked(v) for v in value)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (dtype, shape and bytes), for every dtype including fp8 and bool."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_tree_equal(got: Any, want: Any, path: str = "", *, strict: bool = False) -> None:
    """Bit-exact equality of nested dicts, lists and tuples of tensors, NumPy arrays and plain
    values; the message names the first path that differs. ``strict``: also the same container
    types (a tuple is not a list), and mapping keys of the same types in the same order (an
    integer key is not its string, as a conversion could make it)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and same_tensor(got, want), f"{path}: {got!r} != {want!r}"
    elif isinstance(want, Mapping):
        assert isinstance(got, Mapping) and set(got) == set(want), f"{path}: keys {list(got)} != {list(want)}"
        if strict:
            assert [(type(k), k) for k in got] == [(type(k), k) for k in want], f"{path}: key types or order differ"
        for k in want:
            assert_tree_equal(got[k], want[k], f"{path}.{k}", strict=strict)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want) and (not strict or type(got) is type(want)), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_tree_equal(g, w, f"{path}.{i}", strict=strict)
    elif type(want).__module__ == "numpy" and hasattr(want, "shape"):
        import numpy as np

        assert np.array_equal(got, want), f"{path} differs"
    else:
        assert got == want and (not strict or type(got) is type(want)), f"{path}: {got!r} != {want!r}"
