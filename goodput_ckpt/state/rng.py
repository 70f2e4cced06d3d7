"""Per-rank random number generator state, as tensors.

Every stream a training step can draw from is captured: Python's ``random``, NumPy's global
generator (when NumPy is installed), torch's CPU generator and, once CUDA is initialized in this
process, the generator of every CUDA device. The state is held in plain tensors (no tuples, no
NumPy arrays), so it is written as raw bytes and loads without any unpickling.

Names (the keys under ``rng.rank{r}`` in the checkpoint)::

    python          int64[625]   Mersenne Twister words + position (random.getstate()[1])
    python_gauss    float64[2]   [has gauss_next, gauss_next]
    numpy           int64[624]   MT19937 key (np.random.get_state()[1])
    numpy_pos       int64[2]     [pos, has_gauss]
    numpy_gauss     float64[1]   cached_gaussian
    torch           uint8[N]     torch.get_rng_state()
    cuda{i}         uint8[M]     torch.cuda.get_rng_state(i), one per device

**Across a topology change** a rank's streams cannot carry over (there is no old rank to take
them from). The policy then (:func:`derive_rng`): every new rank seeds all its generators from
``blake2b(base seed, step, new rank)``, where the base seed is ``torch.initial_seed()`` of the
saving job's rank 0, recorded in the manifest. The same restart on the same ranks thus gets the
same streams, and the manager logs what it re-derived.

Why CUDA only once initialized: a process that never initialized CUDA never drew from a CUDA
generator, and reading the state would create a context on every device.
"""

from __future__ import annotations

import hashlib
import random
import struct
from typing import Any

import torch

__all__ = ["capture_rng", "derive_rng", "derived_seed", "describe_rng", "restore_rng"]

_PY_VERSION = 3  # random.getstate() format version of CPython's Mersenne Twister


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def capture_rng() -> dict[str, torch.Tensor]:
    """The current state of every generator, as a flat dict of CPU tensors (see module doc)."""
    out: dict[str, torch.Tensor] = {}
    version, words, gauss = random.getstate()
    if version != _PY_VERSION:  # pragma: no cover - a different Python implementation
        raise RuntimeError(f"unsupported random.getstate() version {version}")
    out["python"] = torch.tensor(words, dtype=torch.int64)
    out["python_gauss"] = torch.tensor([0.0 if gauss is None else 1.0, gauss or 0.0], dtype=torch.float64)
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        if kind == "MT19937":
            out["numpy"] = torch.from_numpy(keys.astype(np.int64))
            out["numpy_pos"] = torch.tensor([int(pos), int(has_gauss)], dtype=torch.int64)
            out["numpy_gauss"] = torch.tensor([float(cached)], dtype=torch.float64)
    out["torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            out[f"cuda{i}"] = torch.cuda.get_rng_state(i)
    return out


def describe_rng(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What a captured state holds, for the manifest (JSON)."""
    return {
        "base_seed": torch.initial_seed(),
        "python": "python" in state,
        "numpy": "numpy" in state,
        "torch": "torch" in state,
        "cuda_devices": sum(1 for k in state if k.startswith("cuda")),
    }


def restore_rng(state: dict[str, torch.Tensor]) -> list[str]:
    """Set every generator present in ``state``.

    Returns:
        Notes on what could not be restored (a NumPy state without NumPy, CUDA states for
        devices this process does not have); the caller warns with them.
    """
    notes: list[str] = []
    if "python" in state:
        words = tuple(int(x) for x in state["python"].tolist())
        has_gauss, gauss = state["python_gauss"].tolist()
        random.setstate((_PY_VERSION, words, gauss if has_gauss else None))
    if "numpy" in state:
        np = _numpy()
        if np is None:
            notes.append("NumPy's RNG state was saved but NumPy is not installed")
        else:
            pos, has_gauss = (int(x) for x in state["numpy_pos"].tolist())
            keys = state["numpy"].numpy().astype(np.uint32)
            np.random.set_state(("MT19937", keys, pos, has_gauss, float(state["numpy_gauss"][0])))
    if "torch" in state:
        torch.set_rng_state(state["torch"].contiguous())
    cuda_keys = sorted((k for k in state if k.startswith("cuda")), key=lambda k: int(k[4:]))
    if cuda_keys:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for k in cuda_keys:
            i = int(k[4:])
            if i < have:
                torch.cuda.set_rng_state(state[k].contiguous(), i)
        if len(cuda_keys) != have:
            notes.append(
                f"the checkpoint holds the RNG state of {len(cuda_keys)} CUDA device(s) and this "
                f"process has {have}; devices beyond the smaller count keep their current state"
            )
    return notes


def derived_seed(base_seed: int, step: int, rank: int) -> int:
    """The seed of ``rank``'s generators after a topology change at ``step`` (module docstring)."""
    raw = struct.pack("<QqQ", int(base_seed) & (2**64 - 1), int(step), int(rank))
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8, person=b"goodput-rng").digest(), "little") >> 1


def derive_rng(base_seed: int, step: int, rank: int) -> int:
    """Seed Python's ``random``, NumPy's global generator, torch's CPU generator and every CUDA
    device from :func:`derived_seed`. Returns the seed, for the log."""
    seed = derived_seed(base_seed, step, rank)
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also every CUDA device (lazily, without creating a context)
    return seed
