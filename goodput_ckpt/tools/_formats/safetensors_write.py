"""Writing safetensors, one file or HF-style shards, through the byte stores (the layouts are in
:mod:`.safetensors_file`, which reads them).

Why a module of its own: reading (header checks, merging torch's distributed partial shards)
and writing (sharding, the index, in-order streaming) share only the format's constants.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from ...errors import OVERWRITE_HINT, CheckpointError, CheckpointExistsError
from ...format.dcp_metadata import dtype_name
from ...storage import Store
from .._common import NO_PROGRESS, Progress
from .base import Source, TensorMeta, alloc, ordered_map
from .objects_json import dump_sidecar
from .safetensors_file import INDEX_SUFFIX, PIECE_BYTES, SIDECAR_SUFFIX, ST_DTYPES
from .sequential_sink import SequentialSink

__all__ = ["write_safetensors"]


def _header(tensors: list[TensorMeta]) -> bytes:
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for t in tensors:
        doc[t.key] = {
            "dtype": ST_DTYPES[dtype_name(t.dtype, t.key)],
            "shape": list(t.shape),
            "data_offsets": [pos, pos + t.nbytes],
        }
        pos += t.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _shards(tensors: list[TensorMeta], shard_bytes: int | None) -> list[list[TensorMeta]]:
    if not shard_bytes:
        return [tensors]
    shards: list[list[TensorMeta]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write_safetensors(
    source: Source,
    store: Store,
    single: str | None,
    *,
    shard_bytes: int | None,
    overwrite: bool,
    thread_count: int,
    progress: Progress = NO_PROGRESS,
) -> list[str]:
    """Write ``source``'s tensors as safetensors and its other values as the JSON sidecar.

    ``single``: the file name for a single-file output in ``store``; ``None`` writes the
    directory layout of the module docstring. Returns the names written (sidecar last).

    Raises:
        CheckpointError: a tensor has a dtype safetensors cannot hold (nothing is written).
        CheckpointExistsError: an output file exists and ``overwrite`` is false.
    """
    tensors = source.tensors()
    bad = [f"{t.key} ({t.dtype})" for t in tensors if dtype_name(t.dtype, t.key) not in ST_DTYPES]
    if bad:
        raise CheckpointError(
            f"safetensors cannot hold these tensors' dtypes: {', '.join(bad[:8])}; convert to goodput, dcp or torch instead"
        )
    # Decode the objects first: an unencodable one fails before anything is written.
    objects = {m.key: source.object_value(m.key) for m in source.objects()}
    sidecar = dump_sidecar(objects, source.planner_data, source.metadata, source.int_keys)
    shards = _shards(tensors, shard_bytes)
    if single is not None:
        names = [single]
        stem = single[: -len(".safetensors")]
        index_name = None
    elif len(shards) == 1:
        names, stem, index_name = ["model.safetensors"], "model", None
    else:
        n = len(shards)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        stem, index_name = "model", "model" + INDEX_SUFFIX
    sidecar_name = stem + SIDECAR_SUFFIX
    store.prepare()
    _clear(store, single, names + [sidecar_name] + ([index_name] if index_name else []), overwrite)
    progress.start(sum(t.nbytes for t in tensors), "write")
    done: list[str] = []
    try:
        for name, shard in zip(names, shards):
            _write_file(source, store, name, shard, thread_count, progress)
            done.append(name)
    except BaseException:
        # Shards already written have no index or sidecar yet: uncommitted, so removed.
        for name in done:
            store.delete(name)
        raise
    finally:
        progress.close()
    written = list(names)
    if index_name is not None:
        weight_map = {t.key: name for name, shard in zip(names, shards) for t in shard}
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
        store.put_commit_record(index_name, json.dumps(index, indent=2).encode(), replace=True)
        written.append(index_name)
    store.put_commit_record(sidecar_name, sidecar, replace=True)
    written.append(sidecar_name)
    return written


def _clear(store: Store, single: str | None, names: list[str], overwrite: bool) -> None:
    if single is None:
        existing = [
            n
            for n in store.list()
            if "/" not in n and (n.endswith(".safetensors") or n.endswith(INDEX_SUFFIX) or n.endswith(SIDECAR_SUFFIX))
        ]
    else:
        existing = [n for n in names if store.size(n) is not None]
    if existing and not overwrite:
        raise CheckpointExistsError(
            f"{store.uri} already holds {', '.join(existing[:4])}; {OVERWRITE_HINT}",
            path=store.uri,
        )
    # The index goes first, so a crash leaves no index that points at half-written shards.
    for n in sorted(existing, key=lambda n: not n.endswith(INDEX_SUFFIX)):
        store.delete(n)


def _write_file(
    source: Source, store: Store, name: str, tensors: list[TensorMeta], thread_count: int, progress: Progress
) -> None:
    header = _header(tensors)
    pieces = []  # (tensor, first element, last element, file offset)
    pos = len(header)
    for t in tensors:
        step = max(1, PIECE_BYTES // t.itemsize)
        for lo in range(0, t.numel, step):
            hi = min(t.numel, lo + step)
            pieces.append((t, lo, hi, pos + lo * t.itemsize))
        pos += t.nbytes

    def read(piece):
        t, lo, hi, _ = piece
        buf = alloc((hi - lo) * t.itemsize)
        source.read_flat(t.key, lo, hi, buf)
        return buf

    sink = SequentialSink(store, name)
    results = ordered_map(read, pieces, threads=thread_count, ahead=2 * thread_count)
    try:
        sink.write_at(0, [header])
        for piece, buf in zip(pieces, results):
            sink.write_at(piece[3], [buf])
            progress.advance(buf.nbytes)
        sink.close()
    except BaseException:
        results.close()
        sink.abort()
        raise
