"""The coordinator's commit record, built from DCP's global ``Metadata`` and every rank's write
results: the one code path that ``CheckpointWriter.finish`` runs and that
``benchmarks/bench_scale.py`` measures at thousands of simulated ranks.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from .._version import __version__
from ..engine.rank_writes import RankWrites, Written, rank_writes
from ..errors import CheckpointError
from ..format.dcp_metadata import encode_planner_data, encode_storage_meta
from ..format.gc_pause import gc_paused
from ..format.grid import GridChunks
from ..format.manifest import FORMAT_VERSION, REFERENCES_VERSION, Manifest, ObjectEntry, TensorEntry
from .item_entries import items_from_ranks

__all__ = ["RANK_WRITES_KEY", "RankWrites", "Written", "build_manifest", "forget_layouts", "rank_writes"]

#: The index of the one ``WriteResult`` each rank returns (its ``storage_data`` a :class:`RankWrites`).
RANK_WRITES_KEY = "__goodput_ckpt_rank_writes__"


class _LastLayout:
    """The item entries of the last manifest built in this process, by layout: a save whose every
    rank reports the same layout digest, of a state whose tensors are the same, has the same
    entries up to file names. One entry, so memory stays O(one manifest's items)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[Any, ...] | None = None
        self._items: dict[str, TensorEntry | ObjectEntry] = {}
        self._names: tuple[str, ...] = ()
        self.reused = 0  # how many builds took the entries from here (tests, benchmarks)

    def get(self, key: tuple[Any, ...], names: tuple[str, ...]) -> dict[str, TensorEntry | ObjectEntry] | None:
        with self._lock:
            if key != self._key or len(names) != len(self._names):
                return None
            self.reused += 1
            return _renamed(self._items, dict(zip(self._names, names)), names)

    def put(self, key: tuple[Any, ...], items: dict[str, TensorEntry | ObjectEntry], names: tuple[str, ...]) -> None:
        with self._lock:
            self._key, self._items, self._names = key, items, names

    def forget(self) -> None:
        self.put(None, {}, ())  # type: ignore[arg-type]


_last_layout = _LastLayout()


def forget_layouts() -> None:
    """Drop the remembered layout, so that the next build starts from every item (benchmarks)."""
    _last_layout.forget()


@gc_paused()
def build_manifest(
    metadata: Metadata,
    results: list[list[WriteResult]],
    *,
    chunk_size: int,
    created_at: str,
    user_metadata: dict[str, Any],
    version: int = FORMAT_VERSION,
) -> Manifest:
    """The manifest of a save: its files (in rank order) and its items (in DCP's order), in
    format ``version`` (v2: regular shardings as grids; 1 is kept for comparisons and fixtures;
    3 when a rank referenced files of an earlier save, :mod:`.incremental`).

    The first build of a run costs O(ranks + tensors) in Python plus O(ranks x tensors) in numpy
    (:func:`~.item_entries.items_from_ranks`). When every rank's layout digest and every tensor's
    shape, dtype and flags equal the previous build's, the item entries are that build's with the
    new file names: O(ranks + tensors) in all (plans do not change between the saves of a run).

    Raises:
        CheckpointError: a result was not written by :class:`~goodput_ckpt.CheckpointWriter`,
            or an item cannot be stored.
    """
    ranks = [_rank_writes(r) for r in results]
    files = {f.path: f for rw in ranks for f in rw.files}
    if len(files) != sum(len(rw.files) for rw in ranks):  # items address files by rank and position
        raise CheckpointError("two ranks reported the same data file name: the manifest cannot list it once")
    if any(f.base is not None for f in files.values()):
        version = max(version, REFERENCES_VERSION)  # an incremental save (docs/format.md, "References")
    names = tuple(files)
    key = (version, tuple(rw.layout for rw in ranks), _tensor_signature(metadata))
    items = _last_layout.get(key, names)
    if items is None:
        items = items_from_ranks(metadata, ranks, names, grids=version >= 2)
        _last_layout.put(key, items, names)
    return Manifest(
        version=version,
        library_version=__version__,
        torch_version=torch.__version__,
        created_at=created_at,
        world_size=max(1, len(results)),
        chunk_size=chunk_size,
        files=files,
        items=items,
        dcp={
            "version": getattr(metadata, "version", None),
            "planner_data": encode_planner_data(metadata.planner_data),
            "storage_meta": encode_storage_meta(getattr(metadata, "storage_meta", None)),
        },
        metadata=user_metadata,
    )


def _rank_writes(results: list[WriteResult]) -> RankWrites:
    if len(results) != 1 or not isinstance(results[0].storage_data, RankWrites):
        raise CheckpointError("CheckpointWriter.finish got results it did not write")
    return results[0].storage_data


def _tensor_signature(metadata: Metadata) -> tuple[Any, ...]:
    """What the item entries take from ``metadata`` besides the chunks (which the ranks' layout
    digests cover): each key's kind, shape, dtype, layout and ``requires_grad``. O(tensors)."""
    sig: list[Any] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            p = md.properties
            sig.append((fqn, tuple(md.size), p.dtype, p.layout, bool(p.requires_grad), len(md.chunks)))
        else:
            sig.append((fqn, type(md).__name__))
    return tuple(sig)


def _renamed(
    items: dict[str, TensorEntry | ObjectEntry], rename: dict[str, str], names: tuple[str, ...]
) -> dict[str, TensorEntry | ObjectEntry]:
    """``items`` with every file name replaced as ``rename`` says (grids: their name table)."""
    out: dict[str, TensorEntry | ObjectEntry] = {}
    for key, e in items.items():
        if isinstance(e, ObjectEntry):
            out[key] = replace(e, file=rename[e.file])
        elif isinstance(e.chunks, GridChunks):
            g = e.chunks
            out[key] = replace(e, chunks=GridChunks(g.shape, g.block, g.esize, g.runs, names))
        else:
            out[key] = replace(e, chunks=tuple(replace(c, file=rename[c.file]) for c in e.chunks))
    return out
