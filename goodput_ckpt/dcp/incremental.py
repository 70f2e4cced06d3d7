"""Incremental saves: a tensor whose bytes did not change since the last committed save is not
written again; the new manifest references the file that holds it (docs/format.md, "References").

Knowing what did not change must cost less than writing it, so nothing is hashed or compared
byte by byte. A tensor of the state dict is *unchanged* when all of these hold since the last
committed save of this process:

- it is the same memory: same ``data_ptr``, dtype, shape, strides and device; the tracker keeps
  the previous save's tensors referenced, so their memory cannot be freed and handed to another
  tensor in between (a state-dict tensor is a view of a parameter or optimizer state, so this
  costs no memory for them);
- torch's version counter (``_version``, bumped by every in-place operation, shared between a
  parameter and the detached views ``state_dict()`` returns) did not move;
- it is not the storage of a parameter with ``requires_grad=True``. Why: a hand-written update
  through ``param.data`` (``p.data.add_(...)``, older optimizers, EMA code) bypasses the version
  counter; trainable parameters change at every step anyway, so checking them would only risk a
  stale reference for no saving. Frozen weights and buffers are the tensors that pay off.

Every ``full_every``-th save (and the first, and the first after a restore) writes everything: a
bound on how long a change the version counter missed could survive, and a fresh base so that
old steps can be deleted. Each rank decides for its own items; what a rank wrote is remembered
per rank (its files, offsets and chunk digests), so no rank reads a manifest to reference one.

Flow, per save and per rank::

    plan = tracker.plan(state, models, location="step_00000200")   # before staging
    CheckpointWriter(..., reuse=plan)      # writes the changed items, references the others
    tracker.committed(plan)                # after the save committed (never after a failure)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..format.manifest import FileEntry

__all__ = ["IncrementalPlan", "IncrementalTracker", "StoredPiece", "DEFAULT_FULL_EVERY"]

#: Saves per full save: a tensor whose change the version counter missed (a write through
#: ``.data`` to a frozen weight) is caught within this many saves.
DEFAULT_FULL_EVERY = 10

#: (flattened key, chunk offsets or None): how the writer names a rank's item.
ItemKey = tuple[str, tuple[int, ...] | None]


@dataclass(frozen=True)
class StoredPiece:
    """Where a rank's item lies in a committed save: a file (its entry, ``base`` naming the
    location that holds it) and the byte range in it."""

    file: FileEntry
    offset: int
    length: int


@dataclass
class IncrementalPlan:
    """One save's reuse decisions on one rank, handed to ``CheckpointWriter(reuse=...)``.

    ``reusable``: items the writer may reference instead of writing (key -> the chunk offsets
    the rank stored and where they lie).
    ``stored``: filled by the writer with where each item of this save lies (written or
    referenced), for :meth:`IncrementalTracker.committed`.
    ``unstaged``: keys of ``reusable`` whose tensors an async save did not stage (it passed the
    live ones): the writer must reference them, and refuses to write one (its bytes may have
    changed since).
    """

    location: str
    reusable: dict[str, tuple[tuple[int, ...] | None, StoredPiece]]
    full: bool
    signatures: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    stored: dict[ItemKey, StoredPiece] = field(default_factory=dict)
    bytes_written: int = 0
    bytes_referenced: int = 0
    unstaged: frozenset[str] = frozenset()

    def piece(self, key: str, offsets: tuple[int, ...] | None, length: int) -> StoredPiece | None:
        """Where the item ``(key, offsets)`` of ``length`` bytes may be referenced, or ``None``."""
        found = self.reusable.get(key)
        if found is None:
            return None
        at, p = found
        # Another chunk or size is another item; the own location is cleared before the save.
        if at != offsets or p.length != length or p.file.base == self.location:
            return None
        return p


class IncrementalTracker:
    """What each committed save of this process stored, on this rank, and which tensors it saw.

    Args:
        full_every: every ``full_every``-th save writes everything (1: every save is full).
    """

    def __init__(self, full_every: int = DEFAULT_FULL_EVERY) -> None:
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"full_every must be a positive integer, got {full_every!r}")
        self.full_every = full_every
        self._stored: dict[ItemKey, StoredPiece] = {}
        #: key -> its one stored piece, for keys stored as one item (what may be referenced).
        #: Built once per commit from ``_stored`` (which changes only there and at ``reset``),
        #: not at every plan: a LoRA base's ~60-150 frozen keys were regrouped at every save.
        self._single: dict[str, tuple[tuple[int, ...] | None, StoredPiece]] = {}
        self._signatures: dict[str, tuple[Any, ...]] = {}
        self._tensors: dict[str, torch.Tensor] = {}  # keeps the compared memory alive
        self._since_full: int | None = None  # saves committed since the last full one

    def reset(self) -> None:
        """Forget everything: the next save is full (after a restore, the live tensors hold
        another step's bytes)."""
        self._stored, self._single, self._signatures, self._tensors, self._since_full = {}, {}, {}, {}, None

    def plan(self, state: Mapping[str, Any], models: Iterable[torch.nn.Module], *, location: str) -> IncrementalPlan:
        """This save's plan on this rank: call it with the live state dict, before staging."""
        flat = _flat_tensors(state)
        trainable = _trainable_storages(models)
        signatures = {k: _signature(t) for k, t in flat.items() if _storage_key(t) not in trainable}
        full = self._since_full is None or self._since_full + 1 >= self.full_every
        plan = IncrementalPlan(location=location, reusable={}, full=full, signatures=signatures, tensors=flat)
        if full:
            return plan
        before = self._signatures
        for key, sig in signatures.items():
            piece = self._single.get(key)
            if piece is not None and sig == before.get(key):
                plan.reusable[key] = piece
        return plan

    def committed(self, plan: IncrementalPlan) -> None:
        """After ``plan``'s save committed on every rank: its items become the reference base."""
        self._stored = dict(plan.stored)
        by_key: dict[str, list[tuple[tuple[int, ...] | None, StoredPiece]]] = {}
        for (key, offsets), piece in self._stored.items():
            by_key.setdefault(key, []).append((offsets, piece))
        self._single = {k: pieces[0] for k, pieces in by_key.items() if len(pieces) == 1}
        self._signatures = plan.signatures
        self._tensors = {k: t for k, t in plan.tensors.items() if k in plan.signatures}
        self._since_full = 0 if plan.full else (self._since_full or 0) + 1


def located(entry: FileEntry, location: str) -> FileEntry:
    """``entry`` as another location references it: with ``base`` naming where it lives."""
    return entry if entry.base is not None else replace(entry, base=location)


def _flat_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The state dict's tensors by DCP's flattened key (``a.b.0.c``), local shards for DTensors."""
    out: dict[str, torch.Tensor] = {}
    stack: list[tuple[str, Any, int]] = [(str(k), v, 1) for k, v in state.items()]
    while stack:  # bounded by the state's size; depth by DCP's own limit on nesting
        key, value, depth = stack.pop()
        if depth > 64:
            continue  # deeper than any state DCP flattens: written, never referenced
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            if isinstance(local, torch.Tensor) and not local.is_meta:
                out[key] = local
        elif isinstance(value, Mapping):
            stack.extend((f"{key}.{k}", v, depth + 1) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{key}.{i}", v, depth + 1) for i, v in enumerate(value))
    return out


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    return (t.device, t.untyped_storage().data_ptr())


def _trainable_storages(models: Iterable[torch.nn.Module]) -> set[tuple[str, int]]:
    out: set[tuple[str, int]] = set()
    for m in models:
        for p in m.parameters():
            if p.requires_grad:
                local = p.to_local() if hasattr(p, "to_local") else p
                out.add(_storage_key(local))
    return out


def _signature(t: torch.Tensor) -> tuple[Any, ...]:
    # ``torch.Size`` is a tuple and ``stride()`` returns one; a ``torch.device`` compares by
    # value: no conversions (this runs once per tensor of the state at every save).
    return (t.data_ptr(), t._version, t.dtype, t.shape, t.stride(), t.device)
