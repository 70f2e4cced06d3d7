"""A rank's side of an incremental save: which of its items it references instead of writing,
the file list its write results carry, and what it records for the next save.

The decisions come from :class:`~.incremental.IncrementalPlan`; this module only applies them
to the items of one ``write_data`` call, so that ``CheckpointWriter`` stays a thin protocol
class. A referenced item keeps its place in the rank's item order; its file is appended to the
rank's files once, carrying its ``base`` (the sibling location that holds it), and the
coordinator's manifest lists it like any other file (docs/format.md, "References").
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.checkpoint.planner import WriteItem

from ..errors import CheckpointError
from ..format.dcp_metadata import dtype_name
from ..format.manifest import DTYPE_SIZES, FileEntry
from .incremental import IncrementalPlan, StoredPiece, located

__all__ = ["add_referenced_files", "record_stored", "referenced_items"]

#: (file index in the rank's files, byte offset, length) of one item.
Where = tuple[int, int, int]


def referenced_items(reuse: IncrementalPlan | None, items: Sequence[WriteItem], token: str) -> dict[int, StoredPiece]:
    """Item index -> where it is referenced, for the tensors ``reuse`` names as unchanged.

    A reference is dropped (the item is written) when its file name is one this save writes
    (the same random token) or another referenced file of another location has its name: a
    manifest lists each name once.

    Raises:
        CheckpointError: an item the save left unstaged (``reuse.unstaged``) would be written.
    """
    if reuse is None or reuse.full:
        return {}
    refs: dict[int, StoredPiece] = {}
    seen: dict[str, str | None] = {}
    for i, it in enumerate(items):
        td = it.tensor_data
        if td is None:
            continue  # objects are small and always written
        length = DTYPE_SIZES[dtype_name(td.properties.dtype, it.index.fqn)]
        for n in td.chunk.sizes:
            length *= n
        offsets = None if it.index.offset is None else tuple(it.index.offset)
        piece = reuse.piece(it.index.fqn, offsets, length)
        if piece is None or piece.file.path.endswith(f".{token}.bin"):
            continue
        if seen.setdefault(piece.file.path, piece.file.base) != piece.file.base:
            continue
        refs[i] = piece
    for i, it in enumerate(items):
        if i not in refs and it.tensor_data is not None and it.index.fqn in reuse.unstaged:
            raise CheckpointError(
                f"item {it.index.fqn!r} was left unstaged as unchanged but cannot be referenced: it is not "
                "written from live memory that training may have changed since (the next save is full)",
                key=it.index.fqn,
            )
    return refs


def add_referenced_files(
    written: list[FileEntry], where: dict[int, Where], refs: dict[int, StoredPiece]
) -> tuple[list[FileEntry], dict[int, Where]]:
    """The rank's files (``written``, then each referenced file once) and every item's place."""
    files = list(written)
    index: dict[str, int] = {}
    out = dict(where)
    for i, piece in sorted(refs.items()):
        f = index.get(piece.file.path)
        if f is None:
            f = index[piece.file.path] = len(files)
            files.append(piece.file)
        out[i] = (f, piece.offset, piece.length)
    return files, out


def record_stored(
    reuse: IncrementalPlan,
    files: Sequence[FileEntry],
    written: Sequence[tuple[str, tuple[int, ...] | None, int, int, int]],
    bytes_written: int,
    bytes_referenced: int,
) -> None:
    """Remember where every tensor item of this save lies (written here, or still referenced),
    as the next save will reference it; objects are left out (always written)."""
    reuse.stored = {
        (key, offsets): StoredPiece(located(files[f], reuse.location), offset, length)
        for key, offsets, f, offset, length in written
        if offsets is not None
    }
    reuse.bytes_written = bytes_written
    reuse.bytes_referenced = bytes_referenced
