"""Where each rank's RNG and dataloader state lie in a checkpoint, and what a restore reads them into.

Two layouts (the training-state schema, ``state.bundle``):

- **schema 2** (written now): ``rng.rows`` and ``dataloader.rows``, each a ``uint8[W, width]``
  tensor holding row ``r`` for rank ``r`` (``dcp.rank_rows``): one manifest item each at any
  world size. The dataloader rows are as wide as the longest rank's state (:data:`WIDENED_ROWS`);
- **schema 1** (still read): ``rng.rank{r}.<generator>`` and ``dataloader.rank{r}``, one item
  per generator and rank: seven per rank, the bulk of a large job's commit record.

Everything here reads sizes from a manifest that was validated against its files, and checks
them against what the metadata implies before it allocates anything. A restored RNG state is
checked on private generators (:func:`.rng.check_rng`) before :func:`.apply.apply_restore` loads anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..dcp.rank_rows import RankRow
from ..errors import CorruptCheckpointError
from ..format.dcp_metadata import torch_dtype
from ..format.manifest import Manifest, TensorEntry
from .dataloader import decode_dataloader_row, decode_dataloader_state
from .rng import RngLayout, check_layout, check_rng, unpack_rng

__all__ = [
    "DATALOADER",
    "RNG",
    "ROWS",
    "WIDENED_ROWS",
    "blob_template",
    "checked_rng",
    "decode_own_loader_state",
    "loader_states_read",
    "loader_row",
    "old_loader_states",
    "own_row",
    "rank_key",
    "rng_layout_of",
    "rng_row",
    "rng_templates",
    "rows_width",
]

RNG, DATALOADER = "rng", "dataloader"
#: The key, under ``rng`` and ``dataloader``, of the ranks' rows (schema 2).
ROWS = "rows"
#: The rows a save widens to the longest rank's: the save planner must be told
#: (``ReplicaGroupingSavePlanner(widen_rows=...)``).
WIDENED_ROWS = (f"{DATALOADER}.{ROWS}",)


def rank_key(rank: int) -> str:
    """Schema 1's per-rank key component."""
    return f"rank{rank}"


def rows_width(manifest: Manifest, section: str, rows: int, width: int | None, where: str) -> int:
    """The width of ``<section>.rows``, checked: a uint8 ``[rows, width]`` tensor, ``rows`` the
    ranks the metadata records and ``width`` what the RNG layout implies (any width for the
    dataloader's, whose rows are as wide as the widest rank's state).

    Raises:
        CorruptCheckpointError: the entry is missing or of another dtype or shape.
    """
    key = f"{section}.{ROWS}"
    entry = manifest.items.get(key)
    shape = tuple(getattr(entry, "shape", ()))
    if (
        not isinstance(entry, TensorEntry)
        or entry.dtype != "uint8"
        or len(shape) != 2
        or shape[0] != rows
        or (width is not None and shape[1] != width)
    ):
        got = "missing" if entry is None else f"{getattr(entry, 'dtype', 'an object')} {shape}"
        want = f"({rows}, {'n' if width is None else width})"
        raise CorruptCheckpointError(
            f"{where}: {key!r} must be a uint8 tensor of shape {want} (a row per saved rank); it is {got}",
            path=where,
            key=key,
        )
    return shape[1]


def own_row(width: int, rank: int, world_size: int, decode: Callable[[RankRow], Any] | None = None) -> RankRow:
    """This rank's row, to be filled by DCP, and ``decode``d in its read phase (``dcp.rank_rows``)."""
    return RankRow(torch.empty((1, width), dtype=torch.uint8), rank, world_size, decode=decode)


def rng_row(width: int, rank: int, world_size: int, layout: RngLayout, where: str) -> RankRow:
    """This rank's RNG row, checked (:func:`checked_rng`) as soon as the load has filled it."""
    return own_row(width, rank, world_size, decode=lambda row: checked_rng({ROWS: row}, layout, where))


def loader_row(width: int, rank: int, world_size: int, check: Callable[[Any], Any] | None = None) -> RankRow:
    """This rank's dataloader row, decoded and checked (:func:`decode_own_loader_state`) as soon
    as the load has filled it: a bad one fails the load on every rank."""
    return own_row(width, rank, world_size, decode=lambda row: decode_own_loader_state({ROWS: row}, check))


def blob_template(manifest: Manifest, key: str, where: str) -> torch.Tensor:
    """Schema 1: an empty tensor the size of the per-rank item ``key``."""
    entry = manifest.items.get(key)
    if not isinstance(entry, TensorEntry):
        raise CorruptCheckpointError(
            f"{where}: per-rank item {key!r} is missing from the manifest", path=where, key=key
        )
    return torch.empty(entry.shape, dtype=torch_dtype(entry.dtype, key))


def rng_templates(manifest: Manifest, rank: int, where: str) -> dict[str, torch.Tensor]:
    """Schema 1: empty tensors for each of ``rank``'s generators."""
    prefix = f"{RNG}.{rank_key(rank)}."
    out = {k[len(prefix) :]: blob_template(manifest, k, where) for k in manifest.items if k.startswith(prefix)}
    if not out:
        raise CorruptCheckpointError(
            f"{where}: no RNG state under {prefix!r} although the metadata records one", path=where, key=prefix
        )
    return out


def rng_layout_of(meta: dict[str, Any], meta_key: str, where: str) -> RngLayout:
    """Schema 2: the validated slots of the RNG rows, from the training-state metadata."""
    try:
        return check_layout(meta["rng"].get("layout"))
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: manifest metadata '{meta_key}.rng': {e}", path=where, key=RNG) from None


def checked_rng(filled: dict[str, Any], layout: RngLayout | None, where: str) -> dict[str, torch.Tensor]:
    """The generator states DCP filled (a :class:`RankRow` of ``layout``, or schema 1's tensors),
    unpacked and checked on private generators, so that a bad one fails the restore before it
    changes anything.

    Raises:
        CorruptCheckpointError: naming the key.
    """
    ((name, value),) = filled.items()
    if isinstance(value, RankRow) and value.decoded is not None:
        return value.decoded  # checked in the load's read phase
    key = f"{RNG}.{name}" if isinstance(value, RankRow) else f"{RNG}.{name}.*"
    try:
        if isinstance(value, RankRow):
            assert layout is not None, "a schema-2 plan carries its layout"
            key = f"{RNG}.{ROWS}[{value.rank}]"
            state = unpack_rng(value.row, layout)
        else:
            state = value
        check_rng(state)
    except Exception as e:  # noqa: BLE001 - whatever a generator's setter raises: the state is bad
        raise CorruptCheckpointError(f"{where}: {key}: {type(e).__name__}: {e}", path=where, key=key) from None
    return state


def decode_own_loader_state(filled: dict[str, Any], check: Callable[[Any], Any] | None = None) -> Any:
    """This rank's dataloader state, from what DCP filled (its row, or schema 1's blob), passed
    through ``check`` (the loader's position holder joins it to the job-level record and checks
    its saved position, returning the state to apply: ``plan_restore``)."""
    ((name, blob),) = filled.items()
    if isinstance(blob, RankRow) and blob.decoded is not None:
        return blob.decoded  # decoded and checked in the load's read phase
    if isinstance(blob, RankRow):
        state = decode_dataloader_row(blob.row, key=f"{DATALOADER}.{ROWS}[{blob.rank}]")
    else:
        state = decode_dataloader_state(blob, key=f"{DATALOADER}.{name}")
    return state if check is None else check(state)


def old_loader_states(blobs: dict[str, torch.Tensor]) -> list[Any]:
    """An elastic restore's old loader states, in old-rank order: the rows of the whole tensor
    (schema 2), or one blob per old rank (schema 1)."""
    if ROWS in blobs:
        return [decode_dataloader_row(row, key=f"{DATALOADER}.{ROWS}[{r}]") for r, row in enumerate(blobs[ROWS])]
    return [decode_dataloader_state(b, key=f"{DATALOADER}.{k}") for k, b in blobs.items()]


#: The DCP keys of the per-rank dataloader states (``dataloader.rows``, a row per rank, or
#: schema 1's ``dataloader.rank{r}``, see ``state.bundle``).
_LOADER_KEY_PREFIX = f"{DATALOADER}."
_LOADER_ROWS = f"{DATALOADER}.{ROWS}"


def loader_states_read(rows_read: Iterable[Mapping[str, int]], keys_read: Iterable[Mapping[str, int]]) -> int:
    """How many ranks' dataloader states a restore read, from its readers' counters
    (``CheckpointReader.rows_read`` and ``.keys_read``, one mapping per reader): the rows of
    ``dataloader.rows`` plus schema 1's per-rank keys. A same-topology restore reads 1 on each
    rank, an elastic one every old rank's on the coordinator only (docs/manager.md): the restore
    record carries it so that the promise is checked, not assumed."""
    rows = sum(r.get(_LOADER_ROWS, 0) for r in rows_read)
    keys = sum(
        n for k in keys_read for key, n in k.items() if key.startswith(_LOADER_KEY_PREFIX) and key != _LOADER_ROWS
    )
    return rows + keys
