"""Where a load's bytes come from, when not all from one complete checkpoint location.

A plain load reads everything from the location it is given, whose manifest it reads and
checks itself. A two-tier restore (``manager.tiers.restore``) loads from a node's *copy* of a
step instead: the copy holds only what that node's ranks read, every rank already holds the
commit record all ranks agreed on, some files were checked on arrival, and the files the copy
lacks are read from the persistent tier or from chunks received from another node.
:class:`ReadSources` says all of that to :class:`~goodput_ckpt.dcp.reader.CheckpointReader` in
one value (``CheckpointReader(uri, sources=ReadSources(...))``); its default is a plain load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..format.manifest import Manifest
from ..storage.base import FileOrigin

__all__ = ["ReadSources"]


@dataclass(frozen=True)
class ReadSources:
    """Where a :class:`~goodput_ckpt.dcp.reader.CheckpointReader` finds what it reads.

    Attributes:
        partial: the location may hold only some of the files its manifest lists (a node's copy
            of a two-tier checkpoint): files are not checked up front, and a missing one is an
            error only when read.
        manifest: this location's manifest, already read and parsed by the caller (a two-tier
            restore has it from the commit record every rank agreed on): the first load uses it
            instead of reading and parsing it again on every rank. ``None``: the reader reads it.
        checked_files: data files (names as in the manifest) whose every chunk the caller has
            just checked against this manifest (files a two-tier restore fetched and checked on
            arrival): read without hashing them again. Every other file is verified as the
            reader's ``verify`` says, and one read from ``read_from`` always.
        read_from: data files (names as in the manifest) to read from elsewhere than the
            location: the persistent tier's copy of the step, or the chunks received from
            another node. Those files are verified even with ``verify=False`` (which then
            applies to the location's own files only), unless named in ``checked_files``;
            errors name where they came from.
    """

    partial: bool = False
    manifest: Manifest | None = None
    checked_files: frozenset[str] = frozenset()
    read_from: Mapping[str, FileOrigin] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "checked_files", frozenset(self.checked_files))
