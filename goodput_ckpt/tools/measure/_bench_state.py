"""The synthetic training state that ``bench`` and ``benchmarks/`` save and load.

One implementation, so that ``goodput-ckpt bench`` and ``benchmarks/bench_local.py`` measure the
same thing: a model (fp32 and bf16 weights) plus Adam-like fp32 optimizer state, with the size
spread of a real one (a few hundred small tensors, the bulk in tensors of 1 to 64 MiB), built
from a fixed seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["State", "empty_like_nested", "flat_equal", "flatten", "make_state"]

MiB = 1 << 20


@dataclass
class State:
    """A synthetic state and facts about it.

    Attributes:
        nested: ``{"model": {name: t}, "optim": {"state": {name: {"exp_avg": t, "exp_avg_sq": t}}}}``,
            what ``dcp.save`` is given.
        flat: dotted keys -> the same tensors (no copies).
        nbytes: the sum of the tensors' sizes (the payload every GB/s is computed from).
        small: how many tensors are under 64 KiB.
        large: how many are not.
    """

    nested: dict[str, Any]
    flat: dict[str, torch.Tensor]
    nbytes: int
    small: int
    large: int


def make_state(total: int, seed: int = 0) -> State:
    """A model plus Adam-like fp32 state of about ``total`` bytes (fixed by ``seed``).

    Large parameters are 2-D with a log-uniform fp32 size of 1 to 64 MiB (bf16 ones are half);
    each has ``exp_avg`` and ``exp_avg_sq`` in fp32. About 160 small fp32 parameters of 1 to 8
    KiB (norms, biases), each with its two optimizer tensors, add ~480 small tensors (about
    2 MiB, so a state is never smaller than that).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shapes: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for i in range(160):
        shapes.append((f"layers.{i // 4}.norm{i % 4}.weight", (rng.randint(256, 2048),), torch.float32))
    used = sum(math.prod(s) * 12 for _, s, _ in shapes)
    i = 0
    while used < total:
        cols = rng.choice((1024, 2048, 4096))
        fp32_bytes = int(math.exp(rng.uniform(math.log(MiB), math.log(64 * MiB))))
        dtype = rng.choice((torch.float32, torch.bfloat16))
        per_numel = dtype.itemsize + 8
        rows = max(1, min(fp32_bytes // 4, (total - used) // per_numel) // cols)
        shapes.append((f"layers.{i // 4}.proj{i % 4}.weight", (rows, cols), dtype))
        used += rows * cols * per_numel
        i += 1
        if (total - used) < per_numel * cols:
            break
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    flat: dict[str, torch.Tensor] = {}
    nbytes = small = 0
    for name, shape, dtype in shapes:
        p = torch.empty(shape, dtype=torch.float32).uniform_(-1, 1, generator=gen).to(dtype)
        m = torch.empty(shape).normal_(0, 1e-3, generator=gen)
        v = torch.empty(shape).uniform_(0, 1e-6, generator=gen)
        model[name] = p
        optim[name] = {"exp_avg": m, "exp_avg_sq": v}
        flat[f"model.{name}"] = p
        flat[f"optim.state.{name}.exp_avg"] = m
        flat[f"optim.state.{name}.exp_avg_sq"] = v
        for t in (p, m, v):
            nbytes += t.nbytes
            small += t.nbytes < 64 << 10
    return State({"model": model, "optim": {"state": optim}}, flat, nbytes, small, len(flat) - small)


def empty_like_nested(obj: Any) -> Any:
    """A zeroed destination with the structure of ``obj``.

    Its pages are touched here (zeroing), so a load into it pays no page faults: what resuming
    into a live model costs.
    """
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    return {k: empty_like_nested(v) for k, v in obj.items()}


def flatten(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Dotted keys -> tensors of a nested dict."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    out: dict[str, torch.Tensor] = {}
    for k, v in obj.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else k))
    return out


def flat_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same keys, and tensors equal byte for byte."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
