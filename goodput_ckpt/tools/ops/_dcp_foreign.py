"""A stock torch DCP checkpoint (``FileSystemWriter``: ``.metadata`` + ``__<rank>_<n>.distcp``) as
``inspect`` and ``verify`` see it.

Why: ``convert`` reads these directories, so a user should not have to convert one to look
inside. ``.metadata`` is a pickle of DCP's ``Metadata``; it is read under the same size cap and
restricted unpickler as ``convert`` (:mod:`._formats.dcp_metadata`), which needs torch: this
module is imported only once a location is known to be one, so inspecting or verifying our own
format stays free of torch.

What can be verified: DCP records no checksums and no file sizes, only the byte range each item
occupies in its file. So ``verify`` checks that every file ``.metadata`` names is present and
holds the ranges it claims, and that the claims are consistent (chunks inside their tensors,
covering them, long enough for their elements: :func:`check_claims`). The bytes themselves
cannot be checked, and the report says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint import metadata as _md

from ...errors import CheckpointError
from ...storage import Store
from .._formats.dcp_fs import _DATA_FILE, MAX_METADATA_BYTES, METADATA_NAME
from .._formats.dcp_metadata import check_claims, load_metadata, storage_info
from .._formats.input_checks import read_small_capped

__all__ = ["DCP_FORMAT", "DcpItem", "DcpView", "NO_HASHES", "read_dcp"]

#: The ``format`` the reports give a stock DCP checkpoint.
DCP_FORMAT = "torch-dcp"
#: What a DCP verify could not check, said in its report.
NO_HASHES = (
    "torch DCP records no checksums: verified that every file .metadata names is present and holds "
    "the byte ranges it claims; the bytes themselves were not checked"
)


@dataclass
class DcpItem:
    key: str
    kind: str  # tensor or object
    dtype: str | None
    shape: list[int] | None
    shards: int
    bytes: int


@dataclass
class DcpView:
    """What ``.metadata`` says and what the files back.

    Attributes:
        files: each data file named -> the end of the last byte range it must hold.
        sizes: each data file's size (``None``: missing).
        world_size: the ranks that wrote data files (``__<rank>_<n>.distcp``).
        problems: ``(kind, file, message, keys)`` for missing or short files and
            inconsistent claims; empty when everything checked is fine.
    """

    uri: str
    version: str | None
    items: list[DcpItem]
    files: dict[str, int]
    sizes: dict[str, int | None]
    world_size: int | None
    problems: list[tuple[str, str | None, str, list[str]]] = field(default_factory=list)

    @property
    def file_bytes(self) -> int:
        return sum(s for s in self.sizes.values() if s is not None)


def read_dcp(store: Store) -> DcpView:
    """Read and check the DCP checkpoint at ``store`` (module docstring).

    Raises:
        CorruptCheckpointError: ``.metadata`` is over its cap or not DCP metadata.
        CheckpointError: ``.metadata`` needs an unrestricted unpickler (named).
    """
    where = f"{store.uri.rstrip('/')}/{METADATA_NAME}"
    data = read_small_capped(store, METADATA_NAME, MAX_METADATA_BYTES, "DCP metadata")
    if data is None:  # removed since it was seen
        raise CheckpointError(f"{where} is missing", path=where)
    md = load_metadata(data, where, trust_pickle=False)
    items: list[DcpItem] = []
    files: dict[str, int] = {}
    keys_in: dict[str, list[str]] = {}
    problems: list[tuple[str, str | None, str, list[str]]] = []

    def place(key: str, index: Any) -> int:
        info = storage_info(md, index)
        off, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(off) is not int or type(length) is not int or off < 0 or length < 0:
            raise CheckpointError(
                f"{where}: {key!r} has a storage entry with offset {off!r} and length {length!r}", key=key
            )
        files[info.relative_path] = max(files.get(info.relative_path, 0), off + length)
        bucket = keys_in.setdefault(info.relative_path, [])
        if not bucket or bucket[-1] != key:
            bucket.append(key)
        return length

    try:
        for key, smd in md.state_dict_metadata.items():
            if isinstance(smd, _md.TensorStorageMetadata):
                dtype = smd.properties.dtype
                shape = [int(s) for s in smd.size]
                for c in smd.chunks:
                    place(key, _md.MetadataIndex(key, c.offsets))
                items.append(
                    DcpItem(
                        key,
                        "tensor",
                        str(dtype).removeprefix("torch."),
                        shape,
                        len(smd.chunks),
                        math.prod(shape) * dtype.itemsize,
                    )
                )
            elif isinstance(smd, _md.BytesStorageMetadata):
                items.append(DcpItem(key, "object", None, None, 1, place(key, _md.MetadataIndex(key))))
            else:
                problems.append(
                    ("metadata", METADATA_NAME, f"{key!r} has DCP metadata of type {type(smd).__name__}", [key])
                )
    except CheckpointError as e:
        problems.append(("metadata", METADATA_NAME, str(e), [e.key] if e.key else []))
    sizes: dict[str, int | None] = {}
    for name, need in files.items():
        keys = keys_in.get(name, [])
        try:
            size = sizes[name] = store.size(name)
        except CheckpointError as e:  # a name that leaves the directory, a link ...
            sizes[name] = None
            problems.append(("unreadable", name, str(e), keys))
            continue
        shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        if size is None:
            problems.append(
                (
                    "missing",
                    name,
                    f"data file {store.uri.rstrip('/')}/{name} named in .metadata is missing; keys stored in it: {shown}",
                    keys,
                )
            )
        elif size < need:
            problems.append(
                (
                    "size",
                    name,
                    f"data file {store.uri.rstrip('/')}/{name} is {size} bytes but .metadata places bytes up to {need} in it; keys stored in it: {shown}",
                    keys,
                )
            )
    if not problems:
        try:
            check_claims(md, store, METADATA_NAME)  # chunk geometry; the files are known to be there
        except CheckpointError as e:
            problems.append(("metadata", METADATA_NAME, str(e), [e.key] if e.key else []))
    ranks = {int(m.group(1)) for m in map(_DATA_FILE.match, files) if m}
    version = getattr(md, "version", None)
    return DcpView(
        store.uri, version if isinstance(version, str) else None, items, files, sizes, len(ranks) or None, problems
    )
