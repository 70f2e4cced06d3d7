"""The coordinator's commit record, built from DCP's global ``Metadata`` and every rank's write
results: the one code path that ``CheckpointWriter.finish`` runs and that
``benchmarks/bench_scale.py`` measures at thousands of simulated ranks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
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
from .rank_reports import RANK_WRITES_KEY, PackedWrites, RankReport, report_of, unpack

__all__ = [
    "RANK_WRITES_KEY",
    "HeldLayout",
    "RankWrites",
    "Written",
    "build_manifest",
    "forget_layouts",
    "held_layouts",
    "rank_writes",
]


@dataclass(frozen=True)
class HeldLayout:
    """The item entries of one build, by layout: ``key`` is (grids or not, each rank's file count,
    each rank's layout digest, the tensors' signature); ``names`` the build's file names, in the
    order the entries' positions refer to; ``writes`` each rank's rows of that build, packed as
    they came (:class:`~.rank_reports.PackedWrites`: about a tenth of the tables' size). Immutable,
    so a writer can pin it for one save.

    Why the rows are kept: a rank whose layout is the held one sends no rows, but another rank's
    layout may have changed (an incremental save's references add files on the ranks that have
    them; a stateful object on one rank only), and then the entries are built again from every
    rank's rows, the unchanged ranks' taken from here. The cost: the coordinator keeps every
    rank's packed rows between saves (O(ranks x the rank's items), compressed, as received once).
    """

    key: tuple[Any, ...]
    items: dict[str, TensorEntry | ObjectEntry]
    names: tuple[str, ...]
    writes: tuple[PackedWrites | RankWrites, ...] = ()

    @property
    def layouts(self) -> tuple[bytes, ...]:
        """Each rank's layout digest, in rank order."""
        return self.key[2]

    @property
    def file_counts(self) -> tuple[int, ...]:
        """Each rank's file count at that build, in rank order."""
        return self.key[1]


class _LastLayout:
    """The item entries of the last manifest built in this process, by layout: a save whose every
    rank reports the same layout digest, of a state whose tensors are the same, has the same
    entries up to file names. One entry, so memory stays O(one manifest's items)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: HeldLayout | None = None
        self.reused = 0  # how many builds took the entries from here (tests, benchmarks)

    def get(self) -> HeldLayout | None:
        with self._lock:
            return self._held

    def put(self, held: HeldLayout | None) -> None:
        with self._lock:
            self._held = held

    def forget(self) -> None:
        self.put(None)


_last_layout = _LastLayout()


def forget_layouts() -> None:
    """Drop the remembered layout, so that the next build starts from every item (benchmarks)."""
    _last_layout.forget()


def held_layouts() -> HeldLayout | None:
    """The layouts this process's coordinator holds entries for (``None``: none), to announce to
    the ranks and to pin for one save (:mod:`.rank_reports`)."""
    return _last_layout.get()


@gc_paused()
def build_manifest(
    metadata: Metadata,
    results: list[list[WriteResult]],
    *,
    chunk_size: int,
    created_at: str,
    user_metadata: dict[str, Any],
    version: int = FORMAT_VERSION,
    held: HeldLayout | None = None,
) -> Manifest:
    """The manifest of a save: its files (in rank order) and its items (in DCP's order), in
    format ``version`` (v2: regular shardings as grids; 1 is kept for comparisons and fixtures;
    3 when a rank referenced files of an earlier save, :mod:`.incremental`).

    The first build of a run costs O(ranks + tensors) in Python plus O(ranks x tensors) in numpy
    (:func:`~.item_entries.items_from_ranks`). When every rank's layout digest and every tensor's
    shape, dtype and flags equal the previous build's, the item entries are that build's with the
    new file names: O(ranks + tensors) in all (plans do not change between the saves of a run).
    Such ranks may have sent their layout digest without their rows (:mod:`.rank_reports`):
    ``held`` is the entry the coordinator announced to them (default: this process's last).

    Raises:
        CheckpointError: a result was not written by :class:`~goodput_ckpt.CheckpointWriter`,
            a rank sent no rows for a layout that is not held, or an item cannot be stored.
    """
    reports = [report_of(r) for r in results]
    if any(r is None for r in reports):
        raise CheckpointError("CheckpointWriter.finish got results it did not write")
    files = {f.path: f for rep in reports for f in rep.files}
    if len(files) != sum(len(rep.files) for rep in reports):  # items address files by rank and position
        raise CheckpointError("two ranks reported the same data file name: the manifest cannot list it once")
    if any(f.base is not None for f in files.values()):
        version = max(version, REFERENCES_VERSION)  # an incremental save (docs/format.md, "References")
    names = tuple(files)
    counts = tuple(len(rep.files) for rep in reports)
    key = (version >= 2, counts, tuple(rep.layout for rep in reports), _tensor_signature(metadata))
    held = _last_layout.get() if held is None else held
    if held is not None and held.key == key:
        _last_layout.reused += 1
        items = _renamed(held.items, dict(zip(held.names, names)), names)
        _last_layout.put(held)  # this layout is the current one again
    else:
        keys: dict[bytes, bytes] = {}
        rows = [_rows_of(r, rep, held, keys) for r, rep in enumerate(reports)]
        missing = [r for r, w in enumerate(rows) if w is None]
        if missing:
            raise CheckpointError(
                f"rank {missing[0]} (and {len(missing) - 1} more) sent only its layout digest, and the coordinator "
                "holds no entries for this save's layouts: the ranks' state changed in a way their digests do not "
                "cover, or a rank's report was forged"
            )
        items = items_from_ranks(metadata, rows, names, grids=version >= 2)
        del rows  # the tables: the held build keeps each rank's packed rows only
        packed = tuple(rep.writes if rep.writes is not None else held.writes[r] for r, rep in enumerate(reports))
        _last_layout.put(HeldLayout(key, items, names, packed))
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


def _rows_of(rank: int, report: RankReport, held: HeldLayout | None, keys: dict[bytes, bytes]) -> RankWrites | None:
    """The rows of ``rank`` for a build: its own, or (it sent only its layout digest) the held
    build's rows of that rank with this save's files, when the digest is the one held for it and
    it has as many files (rows address files by position). ``None``: neither. Unpacked here
    (:func:`~.rank_reports.unpack`, the shard keys once per digest in ``keys``)."""
    if report.writes is not None:
        return unpack(report.writes, report.files, rank, keys)
    if held is None or rank >= len(held.writes) or held.layouts[rank] != report.layout:
        return None
    kept, count = held.writes[rank], held.file_counts[rank]
    if count != len(report.files):
        return None
    return unpack(kept, report.files, rank, keys)


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
