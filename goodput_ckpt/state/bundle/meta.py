"""The bundle's names and its manifest metadata: section names, the training-state schema, and
the check of what a save recorded (:func:`training_meta`) before a restore plans anything from it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import CheckpointError, CorruptCheckpointError
from ...format.manifest import Manifest
from ..per_rank import DATALOADER, RNG

__all__ = [
    "EXTRA_KEY",
    "META_KEY",
    "MODEL",
    "OPTIMIZER",
    "READ_SCHEMAS",
    "RESERVED_NAMES",
    "SCHEMA_VERSION",
    "Topology",
    "check_stateful",
    "training_meta",
]

SCHEMA_VERSION = 2
#: Training-state schemas this version restores: 1 (RNG under rank-unique keys) and 2.
READ_SCHEMAS = (1, 2)
META_KEY = "training_state"
EXTRA_KEY = "extra"
MODEL, OPTIMIZER = "model", "optimizer"
#: Section names that keyword stateful objects may not take.
RESERVED_NAMES = frozenset({MODEL, OPTIMIZER, RNG, DATALOADER, EXTRA_KEY, "step"})


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its global rank and the world size of the checkpoint group."""

    rank: int
    world_size: int


def check_stateful(stateful: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` for a keyword object that cannot be saved under its name."""
    for name, obj in stateful.items():
        if name in RESERVED_NAMES or "." in name or not name:
            raise TypeError(f"{name!r} cannot name a stateful object: reserved or contains '.'")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"{name}= must have state_dict() and load_state_dict(); got {type(obj).__name__}")


def training_meta(manifest: Manifest, where: str) -> dict[str, Any]:
    """The validated ``training_state`` metadata of a manifest.

    Raises:
        CheckpointError: the checkpoint was not written by ``CheckpointManager``.
        CorruptCheckpointError: the metadata is malformed or of an unknown schema version.
    """
    meta = manifest.metadata.get(META_KEY)
    if meta is None:
        raise CheckpointError(
            f"{where} is a checkpoint without training-state metadata (not written by "
            "CheckpointManager); load it with dcp.load and CheckpointReader instead",
            path=where,
        )

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: manifest metadata '{META_KEY}': {msg}", path=where)

    if not isinstance(meta, dict):
        raise bad("not an object")
    schema = meta.get("schema")
    if isinstance(schema, bool) or schema not in READ_SCHEMAS:
        raise CorruptCheckpointError(
            f"{where}: training-state schema version {schema!r:.40} is not supported (this goodput-ckpt "
            f"reads versions {', '.join(map(str, READ_SCHEMAS))}); upgrade goodput-ckpt",
            path=where,
            version=schema,
        )
    ws = meta.get("world_size")
    if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
        raise bad(f"world_size must be a positive integer, got {ws!r:.40}")
    step = meta.get("step", 0)  # seeds re-derived generators (state.rng.derived_seed: a signed 64-bit field)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 1 << 63:
        raise bad(f"step must be an integer in [0, 2^63), got {step!r:.40}")
    sections = meta.get("sections")
    if not isinstance(sections, list) or not all(isinstance(s, str) for s in sections):
        raise bad("sections must be a list of strings")
    for name in ("rng", "dataloader"):
        if meta.get(name) is not None and not isinstance(meta[name], dict):
            raise bad(f"{name} must be an object or null")
    for name in ("models", "optimizers"):
        v = meta.get(name)
        if v is not None and (not isinstance(v, list) or not all(isinstance(s, str) for s in v)):
            raise bad(f"{name} must be a list of strings or null")
    return meta
