"""The commit record's cost against the number of ranks, with W ranks simulated in one process.

For a Llama-shaped model plus AdamW state (``--layouts 8B,70B,405B``: 9 tensors per layer plus
embedding, final norm and head; parameters bf16, both moments fp32) sharded over W ranks
(``fsdp``: every tensor split along dim 0, torch's chunk rule; ``fsdp-tp``: a (W/8) x 8 mesh,
column-parallel weights split along dim 0 by TP then FSDP, row-parallel ones 2-D (dim 0 by FSDP,
dim 1 by TP), norms split by FSDP and saved by the first TP rank), it builds what DCP hands the
coordinator at ``finish`` (the global ``Metadata`` and every rank's write results, each rank's
items laid out in one file as the writer does) and runs the project's own code path on it, per
phase:

- ``gather``: a pickle round trip of every rank's write results (what DCP's gather moves to the
  coordinator: one ``RankWrites`` per rank; ``torch.gather``: ``FileSystemWriter``'s one
  ``WriteResult`` per item);
- ``build``: :func:`goodput_ckpt.dcp.commit_build.build_manifest` (what ``finish`` runs) on the
  first save of a run; ``build_same``: on a later save with the same layout (the entries reused);
- ``serialize``: ``Manifest.to_json`` (sealed bytes); ``bytes`` is their size;
- ``write``: ``put_commit_record`` on a local directory (fsync + rename);
- ``parse``: ``parse_manifest`` (every check a reader makes; the writer runs it too, as a
  self-check before it commits);
- ``share_dumps``, ``share_loads``: the parsed record pickled by the coordinator and unpickled by
  every other rank of a load (``dcp/manifest_share.py`` broadcasts it; the transport not counted);
- ``rebuild``: ``to_dcp_metadata`` (the ``Metadata`` a load hands DCP's planner);
- ``plan``: one rank's restore planning: ``GridLoadPlanner``'s reads for each of the rank's local
  chunks against the rebuilt metadata (grid arithmetic for v2; torch's own
  ``create_read_items_for_chunk_list``, what ``DefaultLoadPlanner`` runs, for v1 and for
  ``torch.plan``), and the storage lookup of each read.

``--state training`` adds what ``CheckpointManager`` saves besides the model and the moments:
AdamW's ``step`` per parameter and its param-group values (rank 0 keeps them, as the save
planner leaves replicated values on the lowest rank), and every rank's generators and dataloader
position as its rows of two tensors, ``rng.rows`` (``uint8[W, 15094]``) and ``dataloader.rows``
(``uint8[W, 8 + 512]``): training-state schema 2, two more sharded tensors. ``training-v1``
saves them as schema 1 did, six generator tensors and a dataloader blob per rank under keys that
name it: about 7 items per rank, 115 k at 16,384 ranks. ``training-no-rng``: as with
``CheckpointManager(save_rng=False)``, the dataloader rows alone. ``bare`` (the default) is the
model and moments alone, as the figures in ``docs/scale.md`` before 2026-12-06 were measured.

With ``--mesh fsdp`` and neither ``v1`` nor ``torch`` among ``--methods``, the inputs come from
:func:`simulate_compact` (numpy tables, DCP's chunk lists made only if walked), so 16,384 ranks fit
in memory; otherwise from :func:`simulate` (every chunk a Python object, about 1 GB per million).

Side by side, torch DCP's ``.metadata``: the same ``Metadata`` with ``_StorageInfo`` storage data,
``pickle.dumps`` (what ``FileSystemWriter.finish`` writes) and ``pickle.loads`` (what every
rank's ``read_metadata`` does).

Each figure is the min / median / max over ``--repeats`` timed runs; a first, untimed run under
``tracemalloc`` gives each phase's peak of Python allocations (``peak MB``). The methods' order
rotates per repeat and is printed. ``--check`` saves a small many-tensor state with real gloo
processes (2 to 16 ranks) through ``CheckpointWriter`` and compares its manifest with the
simulation of the same layout.

Run: ``.venv/bin/python benchmarks/bench_scale.py --layouts 70B --ranks 64,256 --json scale.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

from goodput_ckpt.dcp import manifest_share
from goodput_ckpt.dcp.commit_build import RANK_WRITES_KEY, build_manifest, forget_layouts
from goodput_ckpt.dcp.load_planner import tensor_read_items
from goodput_ckpt.engine.rank_writes import OBJECT, RankWrites, from_table, layout_of
from goodput_ckpt.format.dcp_metadata import to_dcp_metadata
from goodput_ckpt.format.manifest import ALIGNMENT, DTYPE_SIZES, FileEntry, parse_manifest
from goodput_ckpt.storage import open_store

#: The collector pause load_shared puts around its broadcast (None: a package from before it).
gc_paused = getattr(manifest_share, "gc_paused", None)

MB = 1e6
CHUNK_SIZE = 8 << 20  # the writer's default hash chunk
TP = 8

#: (layers, hidden, intermediate, kv width, vocab): Llama 3 shapes.
MODELS = {
    "8B": (32, 4096, 14336, 1024, 128256),
    "70B": (80, 8192, 28672, 1024, 128256),
    "tiny": (16, 64, 160, 16, 1000),  # for --check: real gloo saves of the same layout
    "405B": (126, 16384, 53248, 1024, 128256),
}


@dataclass(frozen=True)
class Tensor:
    fqn: str
    shape: tuple[int, ...]
    dtype: str
    tp_dim: int | None  # the dimension TP splits (fsdp-tp), None: replicated over TP


def model_tensors(model: str) -> list[Tensor]:
    """The model's parameters (bf16) and AdamW's two moments (fp32), in state-dict order."""
    layers, h, inter, kv, vocab = MODELS[model]
    params: list[tuple[str, tuple[int, ...], int | None]] = [("model.embed_tokens.weight", (vocab, h), 0)]
    for i in range(layers):
        p = f"model.layers.{i}."
        params += [
            (p + "self_attn.q_proj.weight", (h, h), 0),
            (p + "self_attn.k_proj.weight", (kv, h), 0),
            (p + "self_attn.v_proj.weight", (kv, h), 0),
            (p + "self_attn.o_proj.weight", (h, h), 1),
            (p + "mlp.gate_proj.weight", (inter, h), 0),
            (p + "mlp.up_proj.weight", (inter, h), 0),
            (p + "mlp.down_proj.weight", (h, inter), 1),
            (p + "input_layernorm.weight", (h,), None),
            (p + "post_attention_layernorm.weight", (h,), None),
        ]
    params += [("model.norm.weight", (h,), None), ("lm_head.weight", (vocab, h), 0)]
    out = [Tensor(f, s, "bfloat16", t) for f, s, t in params]
    for moment in ("exp_avg", "exp_avg_sq"):
        out += [Tensor(f"optim.state.{f}.{moment}", s, "float32", t) for f, s, t in params]
    return out


#: What ``CheckpointManager`` saves besides the model and moments (``--state training``): AdamW's
#: ``step`` per parameter and its param-group values (replicated: the save planner leaves them on
#: rank 0), and per rank its generators and its dataloader position, under keys naming the rank.
#: (fqn suffix, shape, dtype); shape ``None``: an object of OBJECT_BYTES. ``RNG_ITEMS``: the
#: generators as schema 1 saved them (``--state training-v1``); schema 2 saves them as one row of
#: ``RNG_ROW_BYTES`` per rank (``state.rng.row_width`` of a process with NumPy and no CUDA).
RNG_ROW_BYTES = 15094
RNG_ITEMS = [
    ("python", (625,), "int64"),
    ("python_gauss", (2,), "float64"),
    ("numpy", (624,), "int64"),
    ("numpy_pos", (2,), "int64"),
    ("numpy_gauss", (1,), "float64"),
    ("torch", (5056,), "uint8"),
]
PARAM_GROUP_KEYS = [
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
    "params",
]
LOADER_BYTES, OBJECT_BYTES = 512, 100

Own = tuple[str, tuple[int, ...] | None, str]  # fqn, shape (None: an object), dtype


def own_items(tensors: list[Tensor], rank: int, state: str) -> list[Own]:
    """The items ``rank`` writes that are not shards (``--state training``), in the order the
    writer puts them: first in its file."""
    if state == "bare":
        return []
    out: list[Own] = []
    if rank == 0:
        params = [t.fqn for t in tensors if t.dtype == "bfloat16"]
        out += [(f"optim.state.{f}.step", (), "float32") for f in params]
        out += [(f"optim.param_groups.0.{k}", None, "") for k in PARAM_GROUP_KEYS]
    if state == "training-v1":  # schema 1; schema 2's are rows of sharded tensors (state_tensors)
        out += [(f"rng.rank{rank}.{k}", shape, dtype) for k, shape, dtype in RNG_ITEMS]
        out.append((f"dataloader.rank{rank}", (LOADER_BYTES,), "uint8"))
    return out


def state_tensors(model: str, world: int, state: str) -> list[Tensor]:
    """The sharded tensors of a save: the model's and the moments, and with a schema-2 training
    state the ranks' rows (row ``r`` on rank ``r``), last in state-dict order."""
    out = model_tensors(model)
    if state == "training":
        out.append(Tensor("rng.rows", (world, RNG_ROW_BYTES), "uint8", None))
    if state in ("training", "training-no-rng"):
        out.append(Tensor("dataloader.rows", (world, 8 + LOADER_BYTES), "uint8", None))
    return out


ROWS_KEYS = ("rng.rows", "dataloader.rows")


def own_metadata(item: Own) -> TensorStorageMetadata | BytesStorageMetadata:
    fqn, shape, dtype = item
    if shape is None:
        return BytesStorageMetadata()
    chunk = ChunkStorageMetadata(offsets=torch.Size((0,) * len(shape)), sizes=torch.Size(shape))
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=getattr(torch, dtype)), size=torch.Size(shape), chunks=[chunk]
    )


def own_length(item: Own) -> int:
    _, shape, dtype = item
    return OBJECT_BYTES if shape is None else math.prod(shape) * DTYPE_SIZES[dtype]


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """torch's chunk rule: blocks of ceil(n / parts), the last smaller, empty ones dropped."""
    c = -(-n // parts) if n else 0
    return [(o, min(c, n - o)) for o in range(0, n, c)] if c else []


Chunk = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, rank


def shard(t: Tensor, world: int, mesh: str) -> list[Chunk]:
    """The non-empty chunks of ``t`` over ``world`` ranks, in rank order (DCP's order)."""
    rest = t.shape[1:]
    zeros = (0,) * len(rest)
    if mesh == "fsdp" or world % TP or t.fqn in ROWS_KEYS:  # a rank row: one per rank, any mesh
        return [((o,) + zeros, (n,) + rest, r) for r, (o, n) in enumerate(_split(t.shape[0], world))]
    dp = world // TP
    out: list[Chunk] = []
    if t.tp_dim is None:  # replicated over TP: the first TP rank of each FSDP group saves it
        out = [((o,) + zeros, (n,) + rest, i * TP) for i, (o, n) in enumerate(_split(t.shape[0], dp))]
    elif t.tp_dim == 0:  # TP splits dim 0, FSDP splits each TP block again (strided sharding)
        for j, (o, n) in enumerate(_split(t.shape[0], TP)):
            out += [((o + o2,) + zeros, (n2,) + rest, i * TP + j) for i, (o2, n2) in enumerate(_split(n, dp))]
    else:  # TP splits dim 1, FSDP dim 0: a 2-D grid
        for i, (o0, n0) in enumerate(_split(t.shape[0], dp)):
            for j, (o1, n1) in enumerate(_split(t.shape[1], TP)):
                out.append(((o0, o1), (n0, n1), i * TP + j))
    return sorted(out, key=lambda c: c[2])


@dataclass
class Simulated:
    """What DCP hands the coordinator at ``finish``, and torch's own metadata for the same save."""

    metadata: Metadata
    results: list[list[WriteResult]]
    torch_metadata: Metadata
    local: dict[int, list[tuple[str, ChunkStorageMetadata]]]  # one rank's chunks, for planning
    chunks: int
    world: int


def simulate(model: str, world: int, mesh: str, plan_rank: int, state: str = "bare") -> Simulated:
    """Build the ``finish`` inputs of a save of ``model`` by ``world`` ranks (no data)."""
    tensors = state_tensors(model, world, state)
    ends = [0] * world
    rank_items: list[list[tuple[MetadataIndex, int, int, tuple[int, ...] | None]]] = [[] for _ in range(world)]
    sd_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    torch_storage: dict[MetadataIndex, _StorageInfo] = {}
    local: dict[int, list[tuple[str, ChunkStorageMetadata]]] = {plan_rank: []}
    count = 0
    owns = [own_items(tensors, rank, state) for rank in range(world)]
    own_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for rank, items in enumerate(owns):  # first in each rank's file, as the writer puts them
        for item in items:
            fqn, shape, _ = item
            md = own_metadata(item)
            own_md[fqn] = md  # after the model's and optimizer's tensors, in state-dict order
            length = own_length(item)
            off = -(-ends[rank] // ALIGNMENT) * ALIGNMENT
            ends[rank] = off + length
            offsets = None if shape is None else (0,) * len(shape)
            index = MetadataIndex(fqn, None if offsets is None else torch.Size(offsets))
            rank_items[rank].append((index, off, length, shape))
            torch_storage[index] = _StorageInfo(f"__{rank}_0.distcp", off, length)
            if isinstance(md, TensorStorageMetadata) and (rank == plan_rank or fqn.startswith("optim.state.")):
                local[plan_rank].append((fqn, md.chunks[0]))  # its own generators, every step
            count += 1
    for t in tensors:
        esize = DTYPE_SIZES[t.dtype]
        chunks = []
        for offsets, sizes, rank in shard(t, world, mesh):
            cm = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            chunks.append(cm)
            length = math.prod(sizes) * esize
            off = -(-ends[rank] // ALIGNMENT) * ALIGNMENT
            ends[rank] = off + length
            index = MetadataIndex(t.fqn, torch.Size(offsets))
            rank_items[rank].append((index, off, length, tuple(sizes)))
            torch_storage[index] = _StorageInfo(f"__{rank}_0.distcp", off, length)
            if rank == plan_rank:
                local[plan_rank].append((t.fqn, cm))
            count += 1
        props = TensorProperties(dtype=getattr(torch, t.dtype))
        sd_md[t.fqn] = TensorStorageMetadata(properties=props, size=torch.Size(t.shape), chunks=chunks)
    sd_md |= own_md
    planner_data = {t.fqn: (t.fqn,) for t in tensors}  # what DCP records for a flat state dict
    planner_data |= {fqn: tuple(fqn.split(".")) for items in owns for fqn, *_ in items}
    results: list[list[WriteResult]] = []
    for rank, items in enumerate(rank_items):  # each rank's one result, as CheckpointWriter returns it
        name = f"rank{rank:05d}-00.0123456789ab.bin"  # the writer's names (data_file_name), same length
        size = ends[rank]
        hashes = tuple(f"{rank:032x}{c:032x}" for c in range(math.ceil(size / CHUNK_SIZE)))
        files = (FileEntry(name, size, hashes),) if items else ()  # a rank without items writes no file
        writes = _from_table(files, [index.fqn for index, *_ in items], _table(items), len(owns[rank]))
        results.append([WriteResult(index=MetadataIndex(RANK_WRITES_KEY), size_in_bytes=size, storage_data=writes)])
    md = Metadata(state_dict_metadata=sd_md, planner_data=planner_data)
    torch_md = Metadata(state_dict_metadata=sd_md, planner_data=planner_data, storage_data=torch_storage)
    return Simulated(md, results, torch_md, local, count, world)


#: Whether the package on the path splits a rank's own items from its shards (RankWrites.own);
#: a package from before that change gets its RankWrites as its writer made them, so that the
#: same script measures it (before/after figures).
_OWN = "own" in RankWrites.__dataclass_fields__


def _from_table(files: tuple[FileEntry, ...], keys: list[str], table: np.ndarray, own: int) -> RankWrites:
    return from_table(files, keys, table, own=own) if _OWN else from_table(files, keys, table)


class _LazyChunks(list):
    """DCP's chunk list of one FSDP tensor, made only if something walks it: the commit build
    counts it (``len``) and walks it only for tensors it lists explicitly, so at 16,384 ranks the
    simulation need not hold 35 M ``ChunkStorageMetadata`` (torch's own coordinator does)."""

    def __init__(self, t: Tensor, world: int) -> None:
        super().__init__()
        self._t, self._world, self._n = t, world, len(_split(t.shape[0], world))

    def _made(self) -> list[ChunkStorageMetadata]:
        if not super().__len__() and self._n:
            super().extend(
                ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                for o, s, _ in shard(self._t, self._world, "fsdp")
            )
        return self

    def __len__(self) -> int:
        return self._n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return list.__iter__(self._made())

    def __getitem__(self, k):  # type: ignore[no-untyped-def]
        return list.__getitem__(self._made(), k)


def simulate_compact(model: str, world: int, plan_rank: int, state: str = "bare") -> Simulated:
    """:func:`simulate` for FSDP without per-chunk Python objects (ours only, any W): each rank's
    ``RankWrites`` table is made with numpy, tensor by tensor across the ranks, and DCP's chunk
    lists are :class:`_LazyChunks`. Same records as :func:`simulate` (``--check-compact``)."""
    tensors = state_tensors(model, world, state)
    held = np.array([len(_split(t.shape[0], world)) for t in tensors])  # ranks 0 .. held-1 hold t
    ends = np.zeros(world, dtype=np.int64)
    cols = np.zeros((len(tensors), world, 8), dtype=np.int64)  # a row per (tensor, rank): RankWrites columns, D = 2
    sd_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    # Own items first in each file: rank 0's table of them, and one shared by the other ranks
    # (the same items under their own keys).
    own_tables: dict[bool, tuple[np.ndarray, int]] = {}
    for first in (True, False):
        if state == "bare":
            own_tables[first] = (np.zeros((0, 8), dtype=np.int64), 0)
            continue
        items = own_items(tensors, 0 if first else 1, state)
        rows = [(None if it[1] is None else (0,) * len(it[1]), own_length(it), it[1]) for it in items]
        table = _table(
            [(MetadataIndex("", None if o is None else torch.Size(o)), 0, n, sh) for o, n, sh in rows], dims=2
        )
        end = 0
        for row, (_, n, _) in zip(table, rows):
            row[1] = -(-end // ALIGNMENT) * ALIGNMENT
            end = int(row[1]) + n
        own_tables[first] = (table, end)
    ends[0] = own_tables[True][1]
    ends[1:] = own_tables[False][1]
    for i, t in enumerate(tensors):
        k, rest = held[i], t.shape[1:]
        c = -(-t.shape[0] // world)
        o0 = np.arange(k, dtype=np.int64) * c
        n0 = np.minimum(c, t.shape[0] - o0)
        length = n0 * math.prod(rest) * DTYPE_SIZES[t.dtype]
        off = -(-ends[:k] // ALIGNMENT) * ALIGNMENT
        ends[:k] = off + length
        row = cols[i, :k]
        row[:, 1], row[:, 2], row[:, 3], row[:, 4], row[:, 6] = off, length, len(t.shape), o0, n0
        if rest:
            row[:, 7] = rest[0]
        props = TensorProperties(dtype=getattr(torch, t.dtype))
        sd_md[t.fqn] = TensorStorageMetadata(properties=props, size=torch.Size(t.shape), chunks=_LazyChunks(t, world))
    owns = [own_items(tensors, rank, state) for rank in range(world)]
    for item in (item for items in owns for item in items):
        sd_md[item[0]] = own_metadata(item)
    keys_by_count: dict[int, tuple[bytes, bytes, np.ndarray]] = {}
    results: list[list[WriteResult]] = []
    for rank in range(world):
        mask = held > rank
        n = int(mask.sum())
        if n not in keys_by_count:  # ranks holding the same number of tensors hold the same ones
            proto = from_table((), [t.fqn for t, m in zip(tensors, mask) if m], np.zeros((n, 8), dtype=np.int64))
            keys_by_count[n] = (proto.keys, proto.keys_digest, mask)
        blob, digest, _ = keys_by_count[n]
        own_table = own_tables[rank == 0][0]
        table = np.concatenate([own_table, cols[mask, rank]])
        own_blob = json.dumps([fqn for fqn, *_ in owns[rank]], separators=(",", ":")).encode()
        size = int(ends[rank])
        name = f"rank{rank:05d}-00.0123456789ab.bin"
        hashes = tuple(f"{rank:032x}{c:032x}" for c in range(math.ceil(size / CHUNK_SIZE)))
        files = (FileEntry(name, size, hashes),) if len(table) else ()
        if _OWN:
            writes = RankWrites(
                files, blob, digest, table, layout_of(digest, table, own_blob), len(own_table), own_blob
            )
        else:
            writes = _from_table(files, json.loads(own_blob) + json.loads(blob), table, len(own_table))
        results.append([WriteResult(index=MetadataIndex(RANK_WRITES_KEY), size_in_bytes=size, storage_data=writes)])
    del cols
    local: dict[int, list[tuple[str, ChunkStorageMetadata]]] = {plan_rank: []}
    for t, k in zip(tensors, held):
        if plan_rank < k:
            c = -(-t.shape[0] // world)
            o0 = plan_rank * c
            box = ChunkStorageMetadata(
                offsets=torch.Size((o0,) + (0,) * (len(t.shape) - 1)),
                sizes=torch.Size((min(c, t.shape[0] - o0),) + t.shape[1:]),
            )
            local[plan_rank].append((t.fqn, box))
    for item in owns[plan_rank] + [it for it in owns[0] if it[0].startswith("optim.state.")]:
        md_item = sd_md[item[0]]
        if isinstance(md_item, TensorStorageMetadata):
            local[plan_rank].append((item[0], md_item.chunks[0]))
    planner_data = {t.fqn: (t.fqn,) for t in tensors} | {
        fqn: tuple(fqn.split(".")) for items in owns for fqn, *_ in items
    }
    md = Metadata(state_dict_metadata=sd_md, planner_data=planner_data)
    return Simulated(md, results, md, local, int(held.sum()) + sum(map(len, owns)), world)


def _table(items: list[tuple[MetadataIndex, int, int, tuple[int, ...] | None]], dims: int = 0) -> np.ndarray:
    """A rank's ``RankWrites`` table (what ``rank_writes`` builds on a real rank), made with numpy
    per dimension count: the rows of its items (one file), in item order; sizes ``None``: an
    object. At least ``dims`` offset columns."""
    dims = max([dims] + [len(sz) for *_, sz in items if sz is not None])
    table = np.zeros((len(items), 4 + 2 * dims), dtype=np.int64)
    if not items:
        return table
    table[:, 1] = [off for _, off, _, _ in items]
    table[:, 2] = [n for _, _, n, _ in items]
    nd = np.array([OBJECT if sz is None else len(sz) for *_, sz in items])
    table[:, 3] = nd
    for d in range(1, dims + 1):
        rows = np.flatnonzero(nd == d)
        if len(rows):
            table[rows, 4 : 4 + d] = [tuple(items[i][0].offset) for i in rows]
            table[rows, 4 + dims : 4 + dims + d] = [items[i][3] for i in rows]
    return table


@dataclass
class Phase:
    name: str
    seconds: list[float]
    peak_mb: float = 0.0
    bytes: int = 0


def _run(fn: Callable[[], Any], memory: bool) -> tuple[Any, float, float]:
    gc.collect()
    if memory:
        tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    peak = 0.0
    if memory:
        peak = (tracemalloc.get_traced_memory()[1] - base) / MB
        tracemalloc.stop()
    return out, dt, peak


def plan_one_rank(
    md: Metadata, local: list[tuple[str, ChunkStorageMetadata]], read_items: Callable[..., list[Any]]
) -> list[Any]:
    """One rank's restore planning against ``md``: ``read_items`` for each local chunk (torch's
    ``create_read_items_for_chunk_list``, or ``GridLoadPlanner``'s ``tensor_read_items``), and
    each read's location."""
    items = []
    storage = md.storage_data
    for fqn, chunk in local:
        for ri in read_items(fqn, md.state_dict_metadata[fqn], [chunk]):
            storage[ri.storage_index]
            items.append(ri)
    return items


def plan_exchange(plan: LoadPlan, world: int) -> int:
    """The coordinator's share of ``dcp.load``'s plan gather and scatter when every rank's local
    plan is like ``plan``: W plans unpickled, W pickled back (the transport itself not counted).
    ``GridLoadPlanner`` sends empty plans; ``DefaultLoadPlanner`` sends every read item."""
    blob = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    for _ in range(world):
        pickle.dumps(pickle.loads(blob), protocol=pickle.HIGHEST_PROTOCOL)
    return len(blob) * world


def _paused(fn: Callable[[Any], Any], arg: Any) -> Any:
    if gc_paused is None:  # a package whose load_shared does not pause
        return fn(arg)
    with gc_paused():
        return fn(arg)


def ours(sim: Simulated, store: Any, plan_rank: int, memory: bool, timings: dict[str, Phase], version: int) -> None:
    """The goodput-ckpt phases in format ``version``, each timed (and, with ``memory``, traced) once."""
    prefix = f"v{version}."

    def rec(name: str, fn: Callable[[], Any], nbytes: int = 0) -> Any:
        out, dt, peak = _run(fn, memory)
        ph = timings.setdefault(prefix + name, Phase(prefix + name, []))
        if memory:
            ph.peak_mb = peak
        else:
            ph.seconds.append(dt)
        return out

    results = rec("gather", lambda: pickle.loads(pickle.dumps(sim.results, protocol=pickle.HIGHEST_PROTOCOL)))
    forget_layouts()  # the first save of a run: every item

    def build():
        return build_manifest(
            sim.metadata, results, chunk_size=CHUNK_SIZE, created_at="", user_metadata={}, version=version
        )

    rec("build", build)
    manifest = rec("build_same", build)  # a later save, same layout: the entries reused
    data = rec("serialize", manifest.to_json)
    timings[prefix + "serialize"].bytes = len(data)
    del manifest
    rec("write", lambda: store.put_commit_record("manifest.json", data, replace=True))
    parsed = rec("parse", lambda: parse_manifest(data))
    data = b""
    # A load's ranks get the parsed record from the coordinator (dcp/manifest_share.py: one
    # broadcast_object_list): it pickles once, every other rank unpickles (the transport not counted).
    # (With the collector paused, as load_shared does around the broadcast.)
    shared = rec("share_dumps", lambda: _paused(pickle.dumps, [("ok", parsed)]))
    timings[prefix + "share_dumps"].bytes = len(shared)
    rec("share_loads", lambda: _paused(pickle.loads, shared))
    shared = b""
    md = rec("rebuild", lambda: to_dcp_metadata(parsed))
    parsed = None
    rec("plan", lambda: plan_one_rank(md, sim.local[plan_rank], tensor_read_items))
    if version >= 2:  # GridLoadPlanner keeps the items on their rank: the plans exchanged are empty
        timings[prefix + "exchange"].bytes = rec("exchange", lambda: plan_exchange(LoadPlan([]), sim.world))


def torch_side(sim: Simulated, plan_rank: int, memory: bool, timings: dict[str, Phase]) -> None:
    def rec(name: str, fn: Callable[[], Any]) -> Any:
        out, dt, peak = _run(fn, memory)
        ph = timings.setdefault(name, Phase(name, []))
        if memory:
            ph.peak_mb = peak
        else:
            ph.seconds.append(dt)
        return out

    per_item = [[] for _ in range(sim.world)]  # FileSystemWriter's results: one per item
    for index, info in sim.torch_metadata.storage_data.items():
        per_item[int(info.relative_path[2:].split("_")[0])].append(
            WriteResult(index=index, size_in_bytes=info.length, storage_data=info)
        )
    rec("torch.gather", lambda: pickle.loads(pickle.dumps(per_item, protocol=pickle.HIGHEST_PROTOCOL)))
    per_item = []
    blob = rec("torch.dumps", lambda: pickle.dumps(sim.torch_metadata, protocol=pickle.HIGHEST_PROTOCOL))
    timings["torch.dumps"].bytes = len(blob)
    md = rec("torch.loads", lambda: pickle.loads(blob))
    blob = b""
    items = rec("torch.plan", lambda: plan_one_rank(md, sim.local[plan_rank], create_read_items_for_chunk_list))
    timings["torch.exchange"].bytes = rec("torch.exchange", lambda: plan_exchange(LoadPlan(items), sim.world))


def measure(
    model: str,
    world: int,
    mesh: str,
    repeats: int,
    memory: bool,
    order_log: list[str],
    methods: list[str],
    state: str = "bare",
    plan_rank: int | None = None,
) -> dict[str, Any]:
    plan_rank = world // 2 if plan_rank is None else plan_rank  # a typical rank unless told (--plan-rank)
    t0 = time.perf_counter()
    compact = mesh == "fsdp" and "torch" not in methods and "v1" not in methods
    sim = (
        simulate_compact(model, world, plan_rank, state) if compact else simulate(model, world, mesh, plan_rank, state)
    )
    setup = time.perf_counter() - t0
    timings: dict[str, Phase] = {}
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        store = open_store(tmp)
        for rep in range(repeats + (1 if memory else 0)):
            traced = memory and rep == 0
            order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
            order_log.append(
                f"{model}/{mesh}/W={world} rep {rep}{' (tracemalloc)' if traced else ''}: {' '.join(order)}"
            )
            for m in order:
                if m != "torch":
                    ours(sim, store, plan_rank, traced, timings, int(m[1:]))
                else:
                    torch_side(sim, plan_rank, traced, timings)
    row: dict[str, Any] = {
        "model": model,
        "mesh": mesh,
        "state": state,
        "world": world,
        "plan_rank": plan_rank,
        "tensors": len(sim.metadata.state_dict_metadata),
        "chunks": sim.chunks,
        "setup_s": round(setup, 2),
        "simulation": "compact" if compact else "full",
        "phases": {},
    }
    for ph in timings.values():
        s = sorted(ph.seconds)
        row["phases"][ph.name] = {
            "min": s[0],
            "median": statistics.median(s),
            "max": s[-1],
            "peak_mb": round(ph.peak_mb, 1),
            "bytes": ph.bytes,
        }
    p = row["phases"]
    med = lambda n: p[n]["median"]  # noqa: E731
    for v in ("v1", "v2"):
        if v in methods:
            row[f"{v}_save_s"] = med(f"{v}.build") + med(f"{v}.serialize") + med(f"{v}.parse") + med(f"{v}.write")
            row[f"{v}_save_same_s"] = (
                med(f"{v}.build_same") + med(f"{v}.serialize") + med(f"{v}.parse") + med(f"{v}.write")
            )
            row[f"{v}_restore_s"] = med(f"{v}.parse") + med(f"{v}.rebuild")
            if f"{v}.share_loads" in p:  # what every rank but the coordinator pays before its plan
                row[f"{v}_rank_restore_s"] = med(f"{v}.share_loads") + med(f"{v}.rebuild") + med(f"{v}.plan")
                row[f"{v}_restore_s"] += med(f"{v}.share_dumps")
    if "torch" in methods:
        row["torch_save_s"] = med("torch.dumps")
        row["torch_restore_s"] = med("torch.loads")
    return row


def print_row(row: dict[str, Any]) -> None:
    print(
        f"\n{row['model']} {row['mesh']} {row['state']} W={row['world']} (plan of rank {row['plan_rank']}): {row['tensors']} tensors, {row['chunks']} chunks (setup {row['setup_s']} s)"
    )
    print(f"  {'phase':<12} {'min s':>8} {'median s':>9} {'max s':>8} {'peak MB':>9} {'bytes':>12}")
    for name, ph in row["phases"].items():
        nbytes = f"{ph['bytes']:,}" if ph["bytes"] else ""
        print(f"  {name:<12} {ph['min']:8.3f} {ph['median']:9.3f} {ph['max']:8.3f} {ph['peak_mb']:9.1f} {nbytes:>12}")
    for v in ("v1", "v2"):
        if f"{v}_save_s" not in row:
            continue
        print(
            f"  {v} coordinator: first save {row[f'{v}_save_s']:.3f} s (build+serialize+parse+write), later "
            f"saves {row[f'{v}_save_same_s']:.3f} s (build_same+...), restore {row[f'{v}_restore_s']:.3f} s (parse+rebuild"
            + (
                "+share_dumps); each other rank " + f"{row[f'{v}_rank_restore_s']:.3f} s (share_loads+rebuild+plan)"
                if f"{v}_rank_restore_s" in row
                else ")"
            )
        )
    p = row["phases"]
    if not {"v1.parse", "v2.parse", "torch.loads"} <= set(p):
        return
    print(
        f"  torch .metadata: dumps {row['torch_save_s']:.3f} s, loads {row['torch_restore_s']:.3f} s; "
        f"v2 vs torch: parse {row['torch_restore_s'] / p['v2.parse']['median']:.1f}x faster, bytes "
        f"{p['torch.dumps']['bytes'] / p['v2.serialize']['bytes']:.1f}x smaller; v1 vs v2 bytes "
        f"{p['v1.serialize']['bytes'] / p['v2.serialize']['bytes']:.1f}x"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="8B,70B", help="models, comma-separated (8B, 70B, 405B)")
    ap.add_argument("--mesh", default="fsdp", help="fsdp, fsdp-tp, or both comma-separated")
    ap.add_argument("--ranks", default="64,256", help="world sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--state",
        choices=("bare", "training", "training-v1", "training-no-rng"),
        default="bare",
        help="bare: parameters and AdamW moments; training: also what CheckpointManager saves besides "
        "(AdamW steps and param groups on rank 0, each rank's generators and dataloader position as its "
        "rows of two tensors); training-v1: as schema 1 saved them, seven items per rank; "
        "training-no-rng: training with save_rng=False (no generators)",
    )
    ap.add_argument(
        "--methods",
        default="v1,v2,torch",
        help="what to measure: v1, v2, torch (v1 and torch are slow at 1,024+ ranks)",
    )
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc run")
    ap.add_argument(
        "--plan-rank",
        type=int,
        help="the rank whose restore plan is timed (default W/2, a typical rank; 1: with FSDP a shard of every tensor)",
    )
    ap.add_argument("--check", action="store_true", help="compare real gloo saves (2-16 ranks) with the simulation")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.check:
        from bench_scale_check import run_check  # noqa: PLC0415 - only this mode spawns processes

        return run_check([int(w) for w in args.ranks.split(",")] if args.ranks != "64,256" else [2, 4, 8, 16])
    rows = []
    order_log: list[str] = []
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for model in args.layouts.split(","):
        for mesh in args.mesh.split(","):
            for world in (int(w) for w in args.ranks.split(",")):
                row = measure(
                    model,
                    world,
                    mesh,
                    args.repeats,
                    not args.no_memory,
                    order_log,
                    args.methods.split(","),
                    args.state,
                    args.plan_rank,
                )
                print_row(row)
                sys.stdout.flush()
                rows.append(row)
    print("\norder run:")
    for line in order_log:
        print("  " + line)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows, "order": order_log}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
