"""Reading torch DCP's ``.metadata`` from an untrusted location: what may be unpickled, and which
of its claims the stored files must back before anything is planned or allocated.

``.metadata`` is a pickle of DCP's ``Metadata``. It is loaded with a restricted unpickler that
admits only the handful of DCP dataclasses, ``torch.Size``, dtypes, layouts and memory formats it
is made of (the Python docs' ``find_class`` allow-list pattern), unless the caller passes
``trust_pickle``. Then :func:`check_claims` holds its numbers to the files.
"""

from __future__ import annotations

import io
import math
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as _md

from ...errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ...storage import Store

__all__ = ["check_claims", "load_metadata", "storage_info"]

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``Metadata`` and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def load_metadata(data: bytes, where: str, trust_pickle: bool) -> _md.Metadata:
    """DCP ``Metadata`` from the bytes of a ``.metadata`` file."""
    try:
        md = pickle.loads(data) if trust_pickle else _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{where} cannot be read with the restricted unpickler ({e}). If you trust this "
            "checkpoint, pass --trust-pickle (trust_pickle=True).",
            path=where,
        ) from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises many types
        raise CorruptCheckpointError(
            f"{where} is not a valid DCP metadata file ({type(e).__name__}: {e})", path=where
        ) from None
    if not isinstance(md, _md.Metadata) or not isinstance(md.storage_data, dict):
        raise CorruptCheckpointError(f"{where} does not hold DCP Metadata with storage data", path=where)
    return md


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0


def storage_info(md: _md.Metadata, index: _md.MetadataIndex) -> Any:
    """The storage entry of ``index``, refusing a missing one and DCP storage extensions."""
    info = md.storage_data.get(index)
    if info is None or not isinstance(getattr(info, "relative_path", None), str):
        raise CorruptCheckpointError(
            f"DCP metadata has no storage entry for {index.fqn!r} at {index.offset}", key=index.fqn
        )
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(
            f"{index.fqn!r} was written with DCP storage extensions {list(info.transform_descriptors)}, "
            "which convert does not read",
            key=index.fqn,
        )
    return info


def check_claims(md: _md.Metadata, store: Store, name: str) -> None:
    """Check every shape, chunk and byte range of DCP ``md`` (read from ``name`` in ``store``)
    against the files there.

    Why: the writers plan and allocate from these numbers. A ``.metadata`` that claims a
    2^62-byte tensor with no chunks, or an object many GiB long, would otherwise make
    ``convert`` allocate or loop on the claim. After this check, every tensor's bytes are
    covered by its chunks' element counts, each chunk's archive is at least as long as its
    elements (``torch.save`` stores them uncompressed), and every byte range lies inside
    its file, so the work is bounded by the bytes that really exist.

    Raises:
        CorruptCheckpointError: a claim the stored files cannot back, naming the key.
    """
    where = f"{store.uri.rstrip('/')}/{name}"
    sizes: dict[str, int] = {}

    def bad(key: str, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {key!r} {what}", path=where, key=key)

    def check_range(key: str, info: Any) -> int:
        off, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (_is_count(off) and _is_count(length)):
            raise bad(key, f"has a storage entry with offset {off!r} and length {length!r}, which are not byte counts")
        file = info.relative_path
        if file not in sizes:
            size = store.size(file)
            if size is None:
                raise IncompleteCheckpointError(
                    f"{store.uri}/{file}, which holds {key!r}, is missing", path=file, key=key
                )
            sizes[file] = size
        if off + length > sizes[file]:
            raise bad(key, f"claims bytes [{off}, {off + length}) of {file}, which has {sizes[file]} bytes")
        return length

    for key, smd in md.state_dict_metadata.items():
        if isinstance(smd, _md.BytesStorageMetadata):
            check_range(key, storage_info(md, _md.MetadataIndex(key)))
            continue
        if not isinstance(smd, _md.TensorStorageMetadata):
            continue  # refused by name when the items are read
        dtype = getattr(getattr(smd, "properties", None), "dtype", None)
        size, chunks = getattr(smd, "size", None), getattr(smd, "chunks", None)
        shape = tuple(size) if isinstance(size, (tuple, list)) else None
        if not isinstance(dtype, torch.dtype) or shape is None or not all(_is_count(x) for x in shape):
            raise bad(
                key, f"has dtype {dtype!r} and shape {size!r}; expected a torch dtype and non-negative integer sizes"
            )
        if not isinstance(chunks, list) or not all(isinstance(c, _md.ChunkStorageMetadata) for c in chunks):
            raise bad(key, "has a chunk list that is not a list of DCP chunks")
        es = dtype.itemsize
        total = 0
        for c in chunks:
            offs = tuple(c.offsets) if isinstance(getattr(c, "offsets", None), (tuple, list)) else (None,)
            lens = tuple(c.sizes) if isinstance(getattr(c, "sizes", None), (tuple, list)) else (None,)
            if len(offs) != len(shape) or len(lens) != len(shape) or not all(map(_is_count, offs + lens)):
                raise bad(
                    key, f"has a chunk at {list(offs)} of sizes {list(lens)} that does not fit its shape {list(shape)}"
                )
            if any(o + n > d for o, n, d in zip(offs, lens, shape)):
                raise bad(key, f"has a chunk at {list(offs)} of sizes {list(lens)} outside its shape {list(shape)}")
            n = math.prod(lens)
            length = check_range(key, storage_info(md, _md.MetadataIndex(key, c.offsets)))
            if n * es > length:
                raise bad(key, f"has a chunk at {list(offs)} of {n * es} bytes stored in only {length} bytes")
            total += n
        if total != math.prod(shape):
            raise bad(
                key, f"has shape {list(shape)} ({math.prod(shape)} elements) but its chunks hold {total} elements"
            )
