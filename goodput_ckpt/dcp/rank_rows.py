"""Per-rank values saved as the rows of one tensor: :class:`RankRow`.

Why: a value every rank holds its own copy of (its generators' state) used to be saved under a
key naming the rank (``rng.rank{r}.torch``), one item per rank. The commit record then holds
ranks x values entries, each built, written, parsed and shipped to every rank on its own: about
34 µs apiece, seconds at 16,384 ranks for a training job's six generator tensors per rank
(docs/scale.md). Stored as row ``r`` of one ``(W, *shape)`` tensor, the same values are one item
whatever ``W``: every rank writes a shard of it, as with an FSDP weight, and the coordinator
records them as one grid (format version 2).

A :class:`RankRow` is what a state dict holds in place of that tensor on rank ``r``: the row, and
where it lies. It speaks torch DCP's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``), so DCP plans a shard write and a shard read
for it, and the planners here resolve it to the row (:func:`resolve_rank_row`): DCP's own lookup
resolves only ``torch.Tensor`` values by offset. It is deliberately not a tensor subclass: a
staging copy deep-copies it whole, and no tensor operation ever sees it.

torch's load planner replaces every value of a destination state dict that is not a tensor,
number, string, container or ``None`` with ``None`` (``_init_state_dict``, which materializes
meta tensors). :func:`find_rank_rows` and :func:`put_back_rank_rows` let a load planner set
itself up around that.

Every rank's row must have the same shape; :func:`check_rank_rows` refuses a save whose ranks
disagree, naming the key and the ranks, instead of writing a record that does not tile. Rows
made with ``widen=True`` (a length-prefixed blob, such as a dataloader's state, whose length
differs between ranks) under keys the save planner is told of are the exception: the
coordinator's global plan widens every rank's row of such a key to the longest, and adds a row
for a rank that holds none (:func:`widen_rank_rows`, in the plan DCP already gathers and
scatters: no extra collective); each rank writes its row zero-padded to that width
(:meth:`RankRow.padded`), or zeros. The padding costs ``W x (longest - row)`` bytes, small while
the ranks' blobs are of similar size.

A row may carry ``decode``: :class:`~.load_planner.GridLoadPlanner` runs it as soon as a load has
filled the row, inside DCP's read phase, and keeps its result in ``decoded``. A row that does not
decode then fails the load on every rank (DCP gathers the read phase's outcome), with no
collective of its own; decoded after the load, it would fail on its rank alone while the others
went on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ..errors import CheckpointError

__all__ = [
    "RankRow",
    "check_rank_rows",
    "find_rank_rows",
    "put_back_rank_rows",
    "resolve_rank_row",
    "row_widths",
    "widen_rank_rows",
]


class RankRow:
    """Row ``rank`` of a ``(world_size, *row.shape[1:])`` tensor whose other rows other ranks hold.

    ``row`` has a leading dimension of 1: it is the shard itself, written from and read into in
    place. ``widen``: ``row`` is ``[1, n]`` and the save may widen it to the longest row of any
    rank. ``decode``: what a load makes of the row once filled, kept in ``decoded`` (module doc).
    """

    __slots__ = ("decode", "decoded", "rank", "row", "widen", "world_size")

    def __init__(
        self,
        row: torch.Tensor,
        rank: int,
        world_size: int,
        *,
        widen: bool = False,
        decode: Callable[[RankRow], Any] | None = None,
    ) -> None:
        if row.dim() < 1 or row.shape[0] != 1:
            raise ValueError(f"a rank's row must have a leading dimension of 1, got shape {tuple(row.shape)}")
        if widen and row.dim() != 2:
            raise ValueError(f"a row that may be widened must be [1, n], got shape {tuple(row.shape)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.row, self.rank, self.world_size, self.widen = row, rank, world_size, widen
        self.decode, self.decoded = decode, None

    def padded(self, width: int) -> torch.Tensor:
        """The row, zero-padded to ``width`` columns (itself when already that wide)."""
        have = self.row.shape[-1]
        if width == have:
            return self.row
        if not self.widen or width < have:
            raise ValueError(f"a row of {have} columns cannot be written as {width}")
        out = torch.zeros((1, width), dtype=self.row.dtype)
        out[:, :have] = self.row
        return out

    def size(self) -> torch.Size:
        """The whole tensor's shape (what DCP compares with the saved one)."""
        return torch.Size((self.world_size, *self.row.shape[1:]))

    def _chunk(self) -> ChunkStorageMetadata:
        ndim = self.row.dim()
        return ChunkStorageMetadata(offsets=torch.Size((self.rank,) + (0,) * (ndim - 1)), sizes=self.row.shape)

    # -- torch DCP's checkpointable protocol ----------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        chunk = self._chunk()
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk, properties=TensorProperties.create_from_tensor(self.row), size=self.size()
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        at = tuple(self._chunk().offsets)
        if index.offset is not None and tuple(index.offset) != at:
            raise ValueError(f"{index.fqn}: rank {self.rank} holds the row at {at}, not {tuple(index.offset)}")
        return self.row

    def __repr__(self) -> str:
        return f"RankRow(rank={self.rank}, world_size={self.world_size}, row={tuple(self.row.shape)} {self.row.dtype})"


def resolve_rank_row(
    state_dict: Mapping[str, Any], index: MetadataIndex, widths: Mapping[str, tuple[int, torch.dtype]] | None = None
) -> torch.Tensor | None:
    """The row a planner reads into or writes from for ``index``, or ``None`` when the (flat)
    state dict holds no :class:`RankRow` there and the planner's own lookup applies. A save
    passes the ``widths`` its final plan gives widened rows (:func:`row_widths`): its row
    zero-padded to that width, or zeros where this rank holds no row of that key."""
    obj = state_dict.get(index.fqn)
    wide = (widths or {}).get(index.fqn)
    if wide is not None and obj is None:
        return torch.zeros((1, wide[0]), dtype=wide[1])
    if not isinstance(obj, RankRow):
        return None
    row = obj.__get_tensor_shard__(index)
    return row if wide is None else obj.padded(wide[0])


def widen_rank_rows(plans: Sequence[SavePlan], keys: Collection[str]) -> list[SavePlan]:
    """``plans`` with every rank's row of each of ``keys`` (the rows whose width may differ
    between ranks, named by the caller: the coordinator cannot tell them from its own state
    dict, which may lack them) as wide as the widest, and a row added for each rank that holds
    none (a rank whose save got no such value: it writes zeros, which its format must read as
    "nothing saved"). Plans without such rows are returned as they are."""
    world = len(plans)
    found: dict[str, tuple[int, WriteItem]] = {}  # key -> (widest, one item)
    for plan in plans:
        for item in plan.items:
            data = item.tensor_data
            if item.index.fqn in keys and data is not None:
                widest = found.get(item.index.fqn, (0, item))[0]
                found[item.index.fqn] = (max(widest, data.chunk.sizes[-1]), item)
    if not found:
        return list(plans)
    coordinator = {item.index.fqn for item in plans[0].items}
    for key in found.keys() - coordinator:
        other = next(r for r, p in enumerate(plans) if any(i.index.fqn == key for i in p.items))
        raise CheckpointError(
            f"{key!r}: rank 0 (the coordinator, whose metadata describes these rows) holds no row, "
            f"rank {other} does; a rank without one must be another rank than 0",
            key=key,
        )
    out = []
    for rank, plan in enumerate(plans):
        items, held = [], set()
        for item in plan.items:
            if item.index.fqn in found:
                held.add(item.index.fqn)
                item = _row_item(item, rank, world, found[item.index.fqn][0])
            items.append(item)
        items += [_row_item(proto, rank, world, width) for key, (width, proto) in found.items() if key not in held]
        out.append(dataclasses.replace(plan, items=items))
    return out


def _row_item(proto: WriteItem, rank: int, world: int, width: int) -> WriteItem:
    """``proto``'s write item (a row of a 2-D uint8 tensor) for row ``rank`` of ``world``,
    ``width`` wide."""
    data = proto.tensor_data
    assert data is not None
    chunk = ChunkStorageMetadata(offsets=torch.Size((rank, 0)), sizes=torch.Size((1, width)))
    return dataclasses.replace(
        proto,
        index=MetadataIndex(proto.index.fqn, chunk.offsets),
        tensor_data=TensorWriteData(chunk=chunk, properties=data.properties, size=torch.Size((world, width))),
    )


def row_widths(plan: SavePlan, keys: Collection[str]) -> dict[str, tuple[int, torch.dtype]]:
    """The width (and dtype) this rank's final ``plan`` gives each of ``keys``' rows."""
    return {
        item.index.fqn: (int(item.tensor_data.chunk.sizes[-1]), item.tensor_data.properties.dtype)
        for item in plan.items
        if item.index.fqn in keys and item.tensor_data is not None
    }


def find_rank_rows(state_dict: Mapping[str, Any]) -> list[tuple[tuple[str, ...], RankRow]]:
    """Every :class:`RankRow` in a nested state dict (dicts only: where the manager puts them),
    with its path of keys."""
    found: list[tuple[tuple[str, ...], RankRow]] = []
    stack: list[tuple[tuple[str, ...], Mapping[str, Any]]] = [((), state_dict)]
    while stack:
        path, d = stack.pop()
        for k, v in d.items():
            if isinstance(v, RankRow):
                found.append(((*path, k), v))
            elif isinstance(v, Mapping):
                stack.append(((*path, k), v))
    return found


def put_back_rank_rows(
    found: Sequence[tuple[tuple[str, ...], RankRow]],
    nested: MutableMapping[str, Any],
    flat: MutableMapping[str, Any],
    mappings: Mapping[str, tuple[Any, ...]] | None,
) -> None:
    """Restore the rows :func:`find_rank_rows` found, in the nested state dict and in the
    planner's flat one (``mappings``: flat key -> path, as torch's ``flatten_state_dict`` gives;
    ``None`` when the planner does not flatten)."""
    if not found:
        return
    flat_key = {tuple(map(str, path)): key for key, path in (mappings or {}).items()}
    for path, row in found:
        parent = nested
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = row
        if mappings is not None:
            flat[flat_key.get(path, ".".join(path))] = row


def check_rank_rows(plans: Sequence[SavePlan]) -> None:
    """Refuse a save whose ranks wrote rows of different shapes under one key.

    DCP would record each rank's row against the first rank's shape, and the record would not
    tile; the commit would fail far from the cause. Only shard items whose chunk is one leading
    row of a tensor with a first dimension of ``len(plans)`` can be rank rows, so this looks at
    those alone.

    Raises:
        CheckpointError: naming the key, two ranks and their shapes.
    """
    seen: dict[str, tuple[int, torch.Size]] = {}
    world = len(plans)
    for rank, plan in enumerate(plans):
        for item in plan.items:
            data = item.tensor_data
            if item.type != WriteItemType.SHARD or data is None or not data.size or data.size[0] != world:
                continue
            if tuple(data.chunk.sizes[:1]) != (1,) or tuple(data.chunk.offsets) != (rank,) + (0,) * (
                len(data.size) - 1
            ):
                continue
            first = seen.setdefault(item.index.fqn, (rank, data.size))
            if first[1] != data.size:
                raise CheckpointError(
                    f"ranks disagree on the shape of the per-rank rows of {item.index.fqn!r}: rank {first[0]} "
                    f"saves {tuple(first[1])}, rank {rank} saves {tuple(data.size)}. For RNG state this means "
                    "the ranks' environments differ (CUDA devices, NumPy); pass CheckpointManager(save_rng=False) "
                    "or make them equal",
                    key=item.index.fqn,
                )
