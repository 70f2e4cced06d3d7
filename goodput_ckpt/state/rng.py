"""Per-rank random number generator state, as tensors.

Every stream a training step can draw from is captured: Python's ``random``, NumPy's global
generator (when NumPy is installed), torch's CPU generator and, once CUDA is initialized in this
process, the generator of every CUDA device. The state is held in plain tensors (no tuples, no
NumPy arrays), so it is written as raw bytes and loads without any unpickling.

Names (the slots of a rank's row, :func:`pack_rng`)::

    python          int64[625]   Mersenne Twister words + position (random.getstate()[1])
    python_gauss    float64[2]   [has gauss_next, gauss_next]
    numpy           int64[624]   MT19937 key (np.random.get_state()[1])
    numpy_pos       int64[2]     [pos, has_gauss]
    numpy_gauss     float64[1]   cached_gaussian
    torch           uint8[N]     torch.get_rng_state()
    cuda{i}         uint8[M]     torch.cuda.get_rng_state(i), one per device

**On disk** (training-state schema 2) all of a rank's generators are one row of bytes, and the
rows of all ranks one ``uint8[W, width]`` tensor, ``rng.rows``: one item in the commit record
whatever the number of ranks (schema 1 saved ``rng.rank{r}.<name>``, one item per generator per
rank: 115 k items at 16,384 ranks; see docs/scale.md). A row starts with one presence byte per
slot of :func:`rng_layout`, then each slot's bytes in order (zeros where absent). The layout
depends on the environment only (NumPy importable, CUDA devices, torch's generator), never on
what this process did, so every rank of a job computes the same one; it is recorded in the
manifest and checked on restore.

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

from ..errors import CheckpointError

__all__ = [
    "MAX_LAYOUT_SLOTS",
    "RngLayout",
    "capture_rng",
    "check_layout",
    "check_rng",
    "derive_rng",
    "derived_seed",
    "describe_rng",
    "pack_rng",
    "restore_rng",
    "rng_layout",
    "row_width",
    "unpack_rng",
]

_PY_VERSION = 3  # random.getstate() format version of CPython's Mersenne Twister

#: One slot of a row: generator name, dtype name, element count.
RngLayout = list[tuple[str, str, int]]
_DTYPES = {"int64": torch.int64, "float64": torch.float64, "uint8": torch.uint8}
#: CUDA's Philox generator state: seed and offset, 8 bytes each.
_CUDA_STATE_BYTES = 16
#: Bounds on a layout read from a manifest: far above any real one (python, 3 NumPy slots, torch,
#: one per CUDA device), before it drives a loop or an allocation.
MAX_LAYOUT_SLOTS = 1024
_MAX_SLOT_BYTES = 1 << 20


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


def describe_rng(state: dict[str, torch.Tensor], layout: RngLayout | None = None) -> dict[str, Any]:
    """What a captured state holds, for the manifest (JSON); with ``layout``, its row's slots."""
    out: dict[str, Any] = {
        "base_seed": torch.initial_seed(),
        "python": "python" in state,
        "numpy": "numpy" in state,
        "torch": "torch" in state,
        "cuda_devices": sum(1 for k in state if k.startswith("cuda")),
    }
    if layout is not None:
        out["layout"] = [list(slot) for slot in layout]
    return out


def rng_layout() -> RngLayout:
    """The slots of this process's row (module doc): the same on every rank of one environment."""
    out: RngLayout = [("python", "int64", 625), ("python_gauss", "float64", 2)]
    if _numpy() is not None:
        out += [("numpy", "int64", 624), ("numpy_pos", "int64", 2), ("numpy_gauss", "float64", 1)]
    out.append(("torch", "uint8", torch.get_rng_state().numel()))
    if torch.cuda.is_available():
        out += [(f"cuda{i}", "uint8", _CUDA_STATE_BYTES) for i in range(torch.cuda.device_count())]
    return out


def _slot_bytes(dtype: str, numel: int) -> int:
    return numel * _DTYPES[dtype].itemsize


def row_width(layout: RngLayout) -> int:
    """Bytes per row: a presence byte per slot, then the slots."""
    return len(layout) + sum(_slot_bytes(d, n) for _, d, n in layout)


def check_layout(raw: Any) -> RngLayout:
    """A layout read from a manifest, validated and bounded.

    Raises:
        ValueError: not a list of at most :data:`MAX_LAYOUT_SLOTS` distinct
            ``[name, dtype, count]`` slots with a known dtype and a bounded size.
    """
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_LAYOUT_SLOTS:
        raise ValueError(f"the RNG layout must be a list of 1 to {MAX_LAYOUT_SLOTS} slots")
    out: RngLayout = []
    for slot in raw:
        if not (isinstance(slot, list) and len(slot) == 3):
            raise ValueError(f"an RNG layout slot must be [name, dtype, count], got {slot!r:.60}")
        name, dtype, numel = slot
        if not isinstance(name, str) or not 0 < len(name) <= 64 or dtype not in _DTYPES:
            raise ValueError(f"bad RNG layout slot {slot!r:.60}")
        if (
            isinstance(numel, bool)
            or not isinstance(numel, int)
            or numel < 0
            or _slot_bytes(dtype, numel) > _MAX_SLOT_BYTES
        ):
            raise ValueError(f"RNG layout slot {name!r}: count must be an integer of at most {_MAX_SLOT_BYTES} bytes")
        want = _slot_spec(name)
        if want is None or dtype != want[0] or (want[1] is not None and numel != want[1]):
            raise ValueError(f"RNG layout slot {slot!r:.60} is not a generator this version knows, in its form")
        out.append((name, dtype, numel))
    names = [n for n, _, _ in out]
    if len(set(names)) != len(out):
        raise ValueError("the RNG layout names a slot twice")
    _check_groups(names)
    return out


#: The generators a row may hold: name -> (dtype, count; ``None``: any bounded count).
_SLOTS: dict[str, tuple[str, int | None]] = {
    "python": ("int64", 625),
    "python_gauss": ("float64", 2),
    "numpy": ("int64", 624),
    "numpy_pos": ("int64", 2),
    "numpy_gauss": ("float64", 1),
    "torch": ("uint8", None),
}
#: Slots restored together: one without the others cannot be set.
_GROUPS = (("python", "python_gauss"), ("numpy", "numpy_pos", "numpy_gauss"))


def _slot_spec(name: str) -> tuple[str, int | None] | None:
    if _cuda_index(name) is not None:
        return ("uint8", _CUDA_STATE_BYTES)
    return _SLOTS.get(name)


def _cuda_index(name: str) -> int | None:
    """The device of a ``cuda{i}`` slot name, or ``None``: ``i`` written in ASCII digits as
    :func:`rng_layout` writes it (``str.isdigit`` also takes ``'²'``, which ``int`` refuses; and
    ``cuda01`` would name device 1 twice)."""
    digits = name[4:]
    if not (name.startswith("cuda") and 0 < len(digits) <= 4 and digits.isascii() and digits.isdigit()):
        return None
    return int(digits) if digits == str(int(digits)) else None


def _check_groups(names: Any) -> None:
    have = set(names)
    for group in _GROUPS:
        if 0 < len(have & set(group)) < len(group):
            raise ValueError(f"the RNG state holds {sorted(have & set(group))} without the rest of {list(group)}")


def check_rng(state: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` (or the generators' own error) unless every state in ``state`` can
    be set: each is set on a private generator first, so a bad one is found before any live
    generator changes. CUDA states (16 bytes each) are checked by size only: setting one needs
    the device."""
    _check_groups(state)
    for name, value in state.items():
        spec = _slot_spec(name)
        flat = value.reshape(-1)
        if spec is None or flat.dtype != _DTYPES[spec[0]] or (spec[1] is not None and flat.numel() != spec[1]):
            raise ValueError(
                f"generator state {name!r} is {flat.dtype} x {flat.numel()}, not a form this version knows"
            )
    _check_values(state)
    if "python" in state:
        random.Random().setstate(_python_state(state))
    if "numpy" in state and _numpy() is not None:
        _numpy().random.RandomState().set_state(_numpy_state(state))
    if "torch" in state:
        torch.Generator().set_state(state["torch"].contiguous())


#: MT19937's 624 32-bit words; its position runs from 0 to 624 (624: regenerate before the next draw).
_MT_WORDS = 624


def _check_values(state: dict[str, torch.Tensor]) -> None:
    """What the generators' own setters do not refuse: NumPy's ``set_state`` takes any position
    (and the next draw then reads outside its buffer, a crash), both take words outside 32 bits
    (cut silently), and a gauss flag is tested for truth. Every value must be what a capture
    makes."""

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(what)

    if "python" in state:
        words = state["python"]
        need(bool(((words[:_MT_WORDS] >= 0) & (words[:_MT_WORDS] < 1 << 32)).all()), "python: a word is not 32-bit")
        need(0 <= int(words[_MT_WORDS]) <= _MT_WORDS, f"python: position {int(words[_MT_WORDS])} is not in [0, 624]")
        need(float(state["python_gauss"][0]) in (0.0, 1.0), "python_gauss: the flag is neither 0 nor 1")
    if "numpy" in state:
        keys, (pos, has_gauss) = state["numpy"], (int(x) for x in state["numpy_pos"].tolist())
        need(bool(((keys >= 0) & (keys < 1 << 32)).all()), "numpy: a word is not 32-bit")
        need(
            0 <= pos <= _MT_WORDS and has_gauss in (0, 1),
            f"numpy_pos: position {pos} or gauss flag {has_gauss} is out of range",
        )


def _python_state(state: dict[str, torch.Tensor]) -> tuple:
    words = tuple(int(x) for x in state["python"].tolist())
    has_gauss, gauss = state["python_gauss"].tolist()
    return (_PY_VERSION, words, gauss if has_gauss else None)


def _numpy_state(state: dict[str, torch.Tensor]) -> tuple:
    np = _numpy()
    pos, has_gauss = (int(x) for x in state["numpy_pos"].tolist())
    keys = state["numpy"].numpy().astype(np.uint32)
    return ("MT19937", keys, pos, has_gauss, float(state["numpy_gauss"][0]))


def pack_rng(state: dict[str, torch.Tensor], layout: RngLayout) -> torch.Tensor:
    """``state`` (:func:`capture_rng`) as one ``uint8[1, width]`` row of ``layout``.

    Raises:
        CheckpointError: a captured generator does not fit its slot, or ``state`` holds one the
            layout has no slot for (this torch's generators differ from what the layout says).
    """
    extra = sorted(set(state) - {n for n, _, _ in layout})
    if extra:
        raise CheckpointError(f"RNG state {extra} has no slot in the row layout; save with save_rng=False", key="rng")
    row = torch.zeros((1, row_width(layout)), dtype=torch.uint8)
    at = len(layout)
    for i, (name, dtype, numel) in enumerate(layout):
        size = _slot_bytes(dtype, numel)
        value = state.get(name)
        if value is not None:
            flat = value.detach().reshape(-1).contiguous()
            if flat.dtype != _DTYPES[dtype] or flat.numel() != numel:
                raise CheckpointError(
                    f"RNG state {name!r} is {flat.dtype} x {flat.numel()}, its slot {dtype} x {numel}: this "
                    "torch's generator differs from what goodput-ckpt expects; save with save_rng=False",
                    key="rng",
                )
            row[0, i] = 1
            row[0, at : at + size] = flat.view(torch.uint8)
        at += size
    return row


def unpack_rng(row: torch.Tensor, layout: RngLayout) -> dict[str, torch.Tensor]:
    """The generators present in ``row`` (:func:`pack_rng`), as :func:`capture_rng` gives them.

    Raises:
        ValueError: the row's width is not the layout's, or a presence byte is neither 0 nor 1.
    """
    flat = row.reshape(-1)
    if flat.dtype != torch.uint8 or flat.numel() != row_width(layout):
        raise ValueError(
            f"an RNG row of {flat.numel()} {flat.dtype} values, the layout needs {row_width(layout)} uint8"
        )
    present = flat[: len(layout)].tolist()
    if any(p not in (0, 1) for p in present):
        raise ValueError("an RNG row's presence bytes must be 0 or 1")
    _check_groups(name for (name, _, _), here in zip(layout, present) if here)
    out: dict[str, torch.Tensor] = {}
    at = len(layout)
    for (name, dtype, numel), here in zip(layout, present):
        size = _slot_bytes(dtype, numel)
        if here:
            out[name] = flat[at : at + size].clone().view(_DTYPES[dtype])
        at += size
    return out


def restore_rng(state: dict[str, torch.Tensor]) -> list[str]:
    """Set every generator present in ``state``.

    Returns:
        Notes on what could not be restored (a NumPy state without NumPy, CUDA states for
        devices this process does not have); the caller warns with them.
    """
    notes: list[str] = []
    # Every name is parsed before any generator is set (a bad one must not leave half the
    # streams restored); check_rng refused names that are not slots already.
    cuda = sorted((i, k) for k in state if (i := _cuda_index(k)) is not None)
    unknown = sorted(k for k in state if _slot_spec(k) is None)
    if unknown:
        raise ValueError(f"generator state {unknown[0]!r:.40} is not a generator this version knows")
    if "python" in state:
        random.setstate(_python_state(state))
    if "numpy" in state:
        np = _numpy()
        if np is None:
            notes.append("NumPy's RNG state was saved but NumPy is not installed")
        else:
            np.random.set_state(_numpy_state(state))
    if "torch" in state:
        torch.set_rng_state(state["torch"].contiguous())
    if cuda:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for i, k in cuda:
            if i < have:
                torch.cuda.set_rng_state(state[k].contiguous(), i)
        if len(cuda) != have:
            notes.append(
                f"the checkpoint holds the RNG state of {len(cuda)} CUDA device(s) and this "
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
