"""The goodput format (ours) as a converter source; its streaming writer is :mod:`.goodput_write`
(re-exported here: ``write_goodput``, ``WriteSummary``, ``dim0_regions``).

Reading: every byte is verified against the manifest's blake3 digests before it is used. A
range read that covers whole hash chunks reads them straight into the destination and hashes
them there; chunks that a range only partly covers go through a small :class:`LoadingCache`
of verified chunks, because the neighbouring range (usually being read by another thread)
needs the rest of the same chunk. So each chunk is read and hashed about once.

Writing: the layout, hashing and commit are the DCP writer's own; see :mod:`.goodput_write`.
"""

from __future__ import annotations

import io
import math
from functools import partial
from typing import Any

import torch

from ...dcp.read_items import load_value
from ...engine.manifest_load import load_manifest
from ...errors import IncompleteCheckpointError
from ...format.commit_record import KeyIndex, bad_chunks, checksum_error, short_read_error
from ...format.dcp_metadata import torch_dtype
from ...format.manifest import Manifest, TensorEntry
from ...format.references import with_references
from ...storage import Store
from .base import Box, LoadingCache, ObjectMeta, OpenFiles, Source, TensorMeta, alloc
from .goodput_write import WriteSummary, dim0_regions, write_goodput

__all__ = ["GoodputSource", "WriteSummary", "dim0_regions", "write_goodput"]


class _VerifiedRanges:
    """Verified ranged reads of one checkpoint's files (see the module docstring)."""

    def __init__(self, store: Store, manifest: Manifest, *, verify: bool, cache_chunks: int) -> None:
        self._store = store
        self._manifest = manifest
        self._verify = verify
        self._keys = KeyIndex(manifest)
        self._files = OpenFiles(store)
        self._cache = LoadingCache(cache_chunks, self._load_chunk)

    def _fill(self, name: str, offset: int, out: memoryview) -> None:
        try:
            self._files.get(name).read_into(offset, [out])
        except IncompleteCheckpointError as e:  # the file shrank or vanished after the size check
            lo, hi = offset, offset + out.nbytes
            raise short_read_error(e, self._keys.joined(name, lo, hi), (lo, hi)) from e

    def _check(self, name: str, index: int, data: memoryview) -> None:
        cs = self._manifest.chunk_size
        if bad_chunks(self._manifest.files[name], cs, index * cs, [data]):
            lo, hi = index * cs, index * cs + data.nbytes
            raise checksum_error(self._store.uri, name, lo, hi, index, self._keys.keys(name, lo, hi))

    def _load_chunk(self, key: tuple[str, int]) -> memoryview:
        name, index = key
        cs = self._manifest.chunk_size
        size = self._manifest.files[name].size
        buf = alloc(min(cs, size - index * cs))
        self._fill(name, index * cs, buf)
        self._check(name, index, buf)
        return buf

    def read(self, name: str, start: int, end: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[start, end)`` of file ``name``, every byte verified."""
        if end <= start:
            return
        if not self._verify:
            self._fill(name, start, out)
            return
        cs = self._manifest.chunk_size
        size = self._manifest.files[name].size
        pos = start
        while pos < end:
            index = pos // cs
            c0, c1 = index * cs, min(size, (index + 1) * cs)
            if pos == c0 and end >= c1:
                # A run of whole chunks: read straight into ``out`` and hash in place.
                stop = size if end >= size else end // cs * cs
                self._fill(name, pos, out[pos - start : stop - start])
                for i in range(index, math.ceil(stop / cs)):
                    a, b = i * cs, min(stop, (i + 1) * cs)
                    self._check(name, i, out[a - start : b - start])
                pos = stop
                continue
            chunk = self._cache.get((name, index))
            stop = min(end, c1)
            out[pos - start : stop - start] = chunk[pos - c0 : stop - c0]
            pos = stop

    def close(self) -> None:
        self._files.close()
        self._cache.clear()


class GoodputSource(Source):
    """A committed goodput-format checkpoint, opened for converting or resharding."""

    format = "goodput"

    def __init__(self, store: Store, *, verify: bool = True, trust_pickle: bool = False, cache_chunks: int = 6) -> None:
        super().__init__()
        self.uri = store.uri
        self.manifest = load_manifest(store)
        self.world_size = self.manifest.world_size
        self.trust_pickle = trust_pickle
        # An incremental step's referenced files are read where they live: the output is standalone.
        files = with_references(store, self.manifest)
        self._ranges = _VerifiedRanges(files, self.manifest, verify=verify, cache_chunks=cache_chunks)
        for key, e in self.manifest.items.items():
            if isinstance(e, TensorEntry):
                self.items[key] = TensorMeta(key, torch_dtype(e.dtype, key), e.shape, e.requires_grad)
            else:
                self.items[key] = ObjectMeta(key)
        pd = self.manifest.dcp.get("planner_data")
        self.planner_data = pd if isinstance(pd, dict) else None
        ik = self.manifest.dcp.get("int_keys")  # checked by the manifest parser
        self.int_keys = ik if isinstance(ik, dict) and self.planner_data is not None else {}
        self.metadata = dict(self.manifest.metadata)
        self.dcp_version = (
            self.manifest.dcp.get("version") if isinstance(self.manifest.dcp.get("version"), str) else None
        )

    def boxes(self, key: str) -> list[Box]:
        e = self.manifest.items[key]
        es = torch_dtype(e.dtype, key).itemsize
        return [Box(c.offsets, c.sizes, partial(self._read_chunk, c.file, c.offset, es)) for c in e.chunks]

    def _read_chunk(self, file: str, base: int, es: int, lo: int, hi: int, out: memoryview) -> None:
        self._ranges.read(file, base + lo * es, base + hi * es, out)

    def object_bytes(self, key: str) -> bytes:
        e = self.manifest.items[key]
        buf = bytearray(e.length)
        self._ranges.read(e.file, e.offset, e.offset + e.length, memoryview(buf))
        return bytes(buf)

    def object_value(self, key: str) -> Any:
        return decode_torch_save(self.object_bytes(key), key, self.trust_pickle)

    def close(self) -> None:
        self._ranges.close()


def decode_torch_save(raw: bytes, key: str, trust_pickle: bool) -> Any:
    """Decode a ``torch.save`` value with ``weights_only=True`` unless ``trust_pickle`` (the
    reader's rule, :func:`goodput_ckpt.dcp.read_items.load_value`)."""
    return load_value(
        raw, key, trust_pickle=trust_pickle, opt_in="--trust-pickle (trust_pickle=True)", map_location="cpu"
    )


def encode_torch_save(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()
