"""Compact save plans, the rank's side: what a rank of a
:class:`~.save_planner.ReplicaGroupingSavePlanner` save sends to the coordinator in place of its
``WriteItem`` list, and how it rebuilds its final items from the compact plan it gets back.

Why: ``dcp.save`` gathers every rank's local plan on the coordinator, pickled. As torch's
``WriteItem`` objects that is O(ranks x tensors) objects to unpickle, dedup, validate and pickle
back (about 80% of a first save's coordinator time, ~0.65 MB a rank for a 70B state with AdamW,
docs/scale.md). Here a rank sends:

- its **schema**: the keys, kinds, tensor properties and global sizes of its items, in its
  order, as one compressed blob with its digest. With FSDP nearly all ranks have the same schema
  (the ranks past a tensor's end differ only by that tensor), so the coordinator decodes one
  schema per group of ranks, not one per rank;
- its **boxes**: each shard's chunk offsets and sizes as one int64 table (what differs between
  ranks), zlib-compressed, read by the coordinator in numpy. Only shards have rows: a whole
  tensor's chunk is its size at offset 0 (checked here, else the plan goes in full), an object
  has none (a 70B state's 723 replicated ``step`` scalars cost 23 KB a rank as rows);
- its ``flatten_state_dict`` mappings, compressed, with their digest (decoded once per group).

Everything the coordinator decompresses is bounded (:func:`inflate`): the boxes to their exact
size, a schema or mappings to :data:`MAX_BLOB` bytes, so a forged or torn payload fails the save
naming the rank instead of exhausting the coordinator's memory.

The empty shards FSDP2 gives ranks past a tensor's end are left out here, on the rank, as the
coordinator's full path leaves them out (:func:`~.save_planner.drop_empty_shards`). Rows that may
be widened (:mod:`.rank_rows`) go with their global size's last dimension as ``-1``: their width
is in their box, and the coordinator widens them all alike.

The coordinator answers each rank with a :class:`CompactFinal`: which of its items that are not
shards it keeps (the replicated ones go to one rank, :mod:`.compact_global`) and the widths of
the widened rows. The rank rebuilds its final ``WriteItem`` list from its own items
(:func:`final_items`): torch's objects then exist only on the rank that writes them. Their index
hints (``MetadataIndex.index``) are left as the rank made them: a hint is only where a lookup
starts (torch's lookup falls back to the offsets), and nothing of it reaches the checkpoint.

These values live only between the ranks of one job, never on disk: changing them changes no
format.
"""

from __future__ import annotations

import hashlib
import pickle
import zlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..errors import CheckpointError

__all__ = [
    "BYTES",
    "MAX_BLOB",
    "SHARD",
    "TENSOR",
    "CompactFinal",
    "CompactLocal",
    "Schema",
    "compact_local",
    "decode_mappings",
    "expand",
    "final_items",
    "inflate",
    "refuse_unplanned",
]

#: Item kinds in a schema (torch's ``WriteItemType`` as small ints).
SHARD, TENSOR, BYTES = 0, 1, 2
_KIND = {WriteItemType.SHARD: SHARD, WriteItemType.TENSOR: TENSOR, WriteItemType.BYTE_IO: BYTES}
_TYPE = {v: k for k, v in _KIND.items()}
#: zlib level for the blobs: 1 compresses the repeated key prefixes about as well as 9, far faster.
_LEVEL = 1
#: The most bytes a compressed schema or mappings blob may decompress to: 64 MiB, about 300x a
#: 70B state's schema (2,904 items), far below what would strain the coordinator.
MAX_BLOB = 64 << 20


def _digest(blob: bytes) -> bytes:
    return hashlib.blake2b(blob, digest_size=16).digest()


def inflate(blob: bytes, limit: int, what: str, *, exact: bool = False) -> bytes:
    """``blob`` decompressed, at most ``limit`` bytes (``exact``: exactly ``limit``).

    Raises:
        CheckpointError: the blob does not decompress, is longer than ``limit`` or (``exact``)
            shorter; ``what`` names it (and the rank that sent it).
    """
    d = zlib.decompressobj()
    try:
        out = d.decompress(blob, max(limit, 1))  # a max_length of 0 would mean no bound at all
    except (zlib.error, TypeError) as e:
        raise CheckpointError(f"{what} does not decompress: {e}") from e
    if d.unconsumed_tail or not d.eof or len(out) > limit:
        raise CheckpointError(f"{what} is torn or decompresses past {limit} bytes")
    if exact and len(out) != limit:
        raise CheckpointError(f"{what} decompresses to {len(out)} bytes, not {limit}")
    return out


@dataclass(frozen=True)
class CompactLocal:
    """A rank's local plan, compact (module doc): in ``SavePlan.planner_data`` of a plan with no
    items. ``boxes`` is ``shards x 2 dims`` int64 (offsets then sizes, zero-padded), zlib'd."""

    schema: bytes
    schema_digest: bytes
    dims: int
    boxes: bytes
    mappings: bytes | None
    mappings_digest: bytes | None

    def box_table(self, shards: int, rank: int | str = "?") -> np.ndarray:
        """The boxes as ``shards x 2 dims`` (the schema's shard count; decompressed to exactly
        that size, :func:`inflate`)."""
        if not 0 <= self.dims <= 64:
            raise CheckpointError(f"rank {rank}'s compact save plan has {self.dims} dimensions")
        size = shards * 2 * self.dims * 8
        raw = inflate(self.boxes, size, f"rank {rank}'s compact save plan's boxes", exact=True)
        return np.frombuffer(raw, dtype=np.int64).reshape(shards, 2 * self.dims)


@dataclass(frozen=True)
class Schema:
    """A decoded schema: per item its key, kind, properties and global size (``-1`` as the last
    dimension of a widened row)."""

    keys: tuple[str, ...]
    kinds: np.ndarray  # int8
    props: tuple[TensorProperties | None, ...]
    sizes: tuple[tuple[int, ...] | None, ...]

    @staticmethod
    def decode(blob: bytes, rank: int | str = "?") -> Schema:
        raw = inflate(blob, MAX_BLOB, f"rank {rank}'s compact save plan's schema")
        try:
            keys, kinds, props, sizes = pickle.loads(raw)
        except Exception as e:  # noqa: BLE001 - anything a forged or torn blob raises
            raise CheckpointError(f"rank {rank}'s compact save plan's schema does not decode: {e}") from e
        kinds = np.frombuffer(kinds, dtype=np.int8)
        if not (len(keys) == len(kinds) == len(props) == len(sizes)):
            raise CheckpointError(f"rank {rank}'s compact save plan's schema has columns of different lengths")
        return Schema(tuple(keys), kinds, tuple(props), tuple(sizes))

    @property
    def shard_rows(self) -> np.ndarray:
        """Per item, its row in the box table (shards only; -1 for the others)."""
        shard = self.kinds == SHARD
        rows = np.full(len(self.kinds), -1, dtype=np.int64)
        rows[shard] = np.arange(int(shard.sum()))
        return rows

    @property
    def shards(self) -> int:
        """How many rows the box table has."""
        return int((self.kinds == SHARD).sum())


def decode_mappings(blob: bytes, rank: int | str = "?") -> Any:
    """A rank's compressed ``flatten_state_dict`` mappings, bounded (:data:`MAX_BLOB`).

    Raises:
        CheckpointError: naming the rank, when they do not decode.
    """
    raw = inflate(blob, MAX_BLOB, f"rank {rank}'s compact save plan's mappings")
    try:
        return pickle.loads(raw)
    except Exception as e:  # noqa: BLE001 - anything a forged or torn blob raises
        raise CheckpointError(f"rank {rank}'s compact save plan's mappings do not decode: {e}") from e


@dataclass(frozen=True)
class CompactFinal:
    """What the coordinator scatters to a rank of a compact save (in ``planner_data``): the
    positions (int32, in the rank's item order) of the items that are not shards it keeps, and
    each widened row's ``(key, width, properties)``; the rank's index and the world size (a
    rank that holds no row of a widened key writes one of zeros there)."""

    keep: bytes
    rank: int
    world: int
    widths: tuple[tuple[str, int, TensorProperties], ...] = ()


def compact_local(
    items: Sequence[WriteItem], mappings: Mapping[str, Any] | None, widen: Collection[str]
) -> CompactLocal | None:
    """``items`` (empty shards already left out) as a :class:`CompactLocal`; ``None`` when an
    item cannot be expressed (a tensor item without its chunk): the rank then sends its plan in
    full."""
    keys, kinds, props, sizes, rows = [], bytearray(), [], [], []
    shards = [it for it in items if it.type == WriteItemType.SHARD and it.tensor_data is not None]
    dims = max((len(it.tensor_data.size) for it in shards), default=0)
    for it in items:
        data = it.tensor_data
        kind = _KIND.get(it.type)
        if kind is None or (kind != BYTES and (data is None or data.chunk is None)):
            return None
        keys.append(it.index.fqn)
        kinds.append(kind)
        if data is None:
            props.append(None)
            sizes.append(None)
            continue
        size = tuple(data.size)
        if kind == TENSOR:
            if tuple(data.chunk.offsets) != (0,) * len(size) or tuple(data.chunk.sizes) != size:
                return None  # not the whole tensor: its box cannot be left out
            props.append(data.properties)
            sizes.append(size)
            continue
        if it.index.fqn in widen and kind == SHARD and len(size) == 2:
            size = (size[0], -1)  # the width is in the box (module doc)
        props.append(data.properties)
        sizes.append(size)
        pad = [0] * (dims - len(size))
        rows.append([*data.chunk.offsets, *pad, *data.chunk.sizes, *pad])
    schema = zlib.compress(pickle.dumps((keys, bytes(kinds), props, sizes), protocol=pickle.HIGHEST_PROTOCOL), _LEVEL)
    boxes = zlib.compress(np.array(rows, dtype=np.int64).reshape(len(rows), 2 * dims).tobytes(), _LEVEL)
    blob = None if mappings is None else zlib.compress(pickle.dumps(mappings, protocol=pickle.HIGHEST_PROTOCOL), _LEVEL)
    return CompactLocal(schema, _digest(schema), dims, boxes, blob, None if blob is None else _digest(blob))


def final_items(items: Sequence[WriteItem], final: CompactFinal) -> list[WriteItem]:
    """This rank's final items: its shards, the other items the coordinator let it keep, its
    widened rows as wide as ``final`` says (and a row of zeros added for each widened key it holds
    none of), in the order the coordinator's full path gives (:func:`~.rank_rows.widen_rank_rows`).
    """
    keep = set(np.frombuffer(final.keep, dtype=np.int32).tolist())
    rank, world = final.rank, final.world
    widths = {key: (width, props) for key, width, props in final.widths}
    out, held = [], set()
    for i, it in enumerate(items):
        if it.type != WriteItemType.SHARD and i not in keep:
            continue  # a replicated value another rank writes
        if it.index.fqn in widths and it.type == WriteItemType.SHARD:
            held.add(it.index.fqn)
            it = _row(it.index.fqn, rank, world, *widths[it.index.fqn])
        out.append(it)
    out += [_row(key, rank, world, width, props) for key, (width, props) in widths.items() if key not in held]
    return out


def _row(key: str, rank: int, world: int, width: int, props: TensorProperties) -> WriteItem:
    """The write item of row ``rank`` of ``key``, ``width`` wide (as :func:`.rank_rows._row_item`)."""
    chunk = ChunkStorageMetadata(offsets=torch.Size((rank, 0)), sizes=torch.Size((1, width)))
    return WriteItem(
        index=MetadataIndex(key, chunk.offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size((world, width))),
    )


def expand(plan: CompactLocal, rank: int | str = "?") -> tuple[list[WriteItem], Any]:
    """The ``WriteItem`` list and mappings a compact plan stands for (the coordinator's full
    path, when a save cannot be planned compactly). A widened row gets its own width back."""
    schema = Schema.decode(plan.schema, rank)
    table = plan.box_table(schema.shards, rank)
    at = schema.shard_rows
    items = []
    for i, key in enumerate(schema.keys):
        kind = int(schema.kinds[i])
        if kind == BYTES:
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
            continue
        size = schema.sizes[i]
        nd = len(size)
        if kind == TENSOR:  # the whole tensor (compact_local checked it)
            offsets, sizes = torch.Size((0,) * nd), torch.Size(size)
        else:
            offsets = torch.Size(table[at[i], :nd].tolist())
            sizes = torch.Size(table[at[i], plan.dims : plan.dims + nd].tolist())
        if nd and size[-1] == -1:
            size = (*size[:-1], sizes[-1])
        items.append(
            WriteItem(
                index=MetadataIndex(key, offsets),
                type=_TYPE[kind],
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=schema.props[i],
                    size=torch.Size(size),
                ),
            )
        )
    mappings = None if plan.mappings is None else decode_mappings(plan.mappings, rank)
    return items, mappings


def refuse_unplanned(plans: Sequence[Any]) -> None:
    """Refuse compact local plans that reached the writer's global step unplanned: the
    coordinator's planner is not :class:`~.save_planner.ReplicaGroupingSavePlanner` while the
    ranks' are, and its plans would write nothing.

    Raises:
        CheckpointError: naming the rank.
    """
    for rank, plan in enumerate(plans):
        if isinstance(getattr(plan, "planner_data", None), CompactLocal):
            raise CheckpointError(
                f"rank {rank}'s save plan is compact (ReplicaGroupingSavePlanner) but the coordinator's planner did "
                "not plan it: use ReplicaGroupingSavePlanner on every rank, or compact=False"
            )
