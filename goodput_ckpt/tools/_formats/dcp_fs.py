"""torch DCP's own ``FileSystemWriter`` layout: ``.metadata`` plus ``__<rank>_<n>.distcp`` files.

Reading. ``.metadata`` is read with a cap, unpickled with a restricted unpickler and its
claims checked against the files (:mod:`.dcp_metadata`). In a ``.distcp`` file each tensor shard is a ``torch.save``
archive. It is first loaded onto the meta device (``weights_only=True``), which reads only its
pickle and index and gives the storage's place in the archive; a contiguous shard is then read
by byte ranges in place, like safetensors, so memory stays at a few ranges. A shard that is a
strided view is decoded whole (``weights_only=True``) into a one-entry cache: memory is then
about one shard. Each non-tensor value is ``torch.save`` bytes, copied as they are into format
v1 and decoded only when a value is needed (``weights_only=True`` unless ``trust_pickle``).

Writing. One ``__0_0.distcp`` file, written in order (whole parts on S3: :mod:`.sequential_sink`):
every non-tensor value, decoded (``weights_only=True`` unless ``trust_pickle``) and saved again
with ``torch.save``, and every tensor as ``torch.save`` archives of row blocks of at most
``block_bytes`` (each block is a DCP chunk; ``dcp.load`` reassembles and reshards chunks itself), so memory
stays at a few blocks. ``.metadata`` is written last, atomically, as the commit. The result
loads with ``dcp.load(..., storage_reader=FileSystemReader(path))``.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import metadata as _md

from ...engine.untrusted_load import check_inflation
from ...errors import (
    OVERWRITE_HINT,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ...storage import FileSource, Store
from .._common import NO_PROGRESS, Progress
from .base import Box, LoadingCache, ObjectMeta, OpenFiles, Source, TensorMeta, ordered_map
from .dcp_metadata import check_claims, load_metadata, storage_info
from .goodput import decode_torch_save, encode_torch_save
from .input_checks import read_small_capped
from .sequential_sink import SequentialSink

__all__ = ["DcpSource", "METADATA_NAME", "write_dcp"]

METADATA_NAME = ".metadata"
DATA_NAME = "__0_0.distcp"
_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp\Z")
#: Rows per block when writing: at most this many bytes per DCP chunk.
BLOCK_BYTES = 32 << 20
#: The largest ``.metadata`` read (the same limit as a goodput manifest): it is unpickled
#: whole in memory, so a larger file is refused before it is read.
MAX_METADATA_BYTES = 1 << 30


class _RangeFile(io.RawIOBase):
    """A read-only, seekable file over bytes ``[offset, offset + length)`` of a store file,
    so that ``torch.load`` decodes an archive without a copy of it in memory."""

    def __init__(self, source: FileSource, offset: int, length: int) -> None:
        self._source, self._offset, self._length, self._pos = source, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b) -> int:
        n = min(len(b), self._length - self._pos)
        if n <= 0:
            return 0
        self._source.read_into(self._offset + self._pos, [memoryview(b).cast("B")[:n]])
        self._pos += n
        return n


class DcpSource(Source):
    """A torch DCP checkpoint written by ``FileSystemWriter``."""

    format = "dcp"

    def __init__(self, store: Store, *, trust_pickle: bool = False) -> None:
        super().__init__()
        self.uri = store.uri
        self._store = store
        self.trust_pickle = trust_pickle
        data = read_small_capped(store, METADATA_NAME, MAX_METADATA_BYTES, "DCP metadata")
        if data is None:
            if any(_DATA_FILE.match(n) for n in store.list()):
                raise IncompleteCheckpointError(
                    f"{store.uri} holds .distcp files but no {METADATA_NAME}: the DCP save never finished",
                    path=store.uri,
                )
            raise CheckpointNotFoundError(f"no DCP checkpoint at {store.uri}", path=store.uri)
        self.md = load_metadata(data, f"{store.uri}/{METADATA_NAME}", trust_pickle)
        self._files = OpenFiles(store)
        self._cache = LoadingCache(1, self._decode)  # shards that cannot be read in place
        self._places: dict[str, list[tuple[str, int] | None]] = {}
        check_claims(self.md, self._store, METADATA_NAME)
        ranks = set()
        for key, smd in self.md.state_dict_metadata.items():
            if isinstance(smd, _md.TensorStorageMetadata):
                self.items[key] = TensorMeta(
                    key, smd.properties.dtype, tuple(smd.size), bool(smd.properties.requires_grad)
                )
                idx = [_md.MetadataIndex(key, c.offsets) for c in smd.chunks]
            elif isinstance(smd, _md.BytesStorageMetadata):
                self.items[key] = ObjectMeta(key)
                idx = [_md.MetadataIndex(key)]
            else:
                raise CheckpointError(
                    f"{key!r} has DCP metadata of type {type(smd).__name__}, which convert does not read", key=key
                )
            for i in idx:
                info = self._info(i)
                m = _DATA_FILE.match(info.relative_path)
                if m:
                    ranks.add(int(m.group(1)))
        self.world_size = len(ranks) or None
        self._refuse_safetensors_serialization()
        pd = self.md.planner_data
        if isinstance(pd, dict) and all(isinstance(v, (tuple, list)) for v in pd.values()):
            self.planner_data = {k: list(v) for k, v in pd.items()}

    def _refuse_safetensors_serialization(self) -> None:
        """Refuse, by name, a save made with ``serialization_format=SAFETENSORS``.

        Why: that layout stores each file's tensors as one safetensors blob, and its metadata
        points every tensor at the blob's start; read as ``torch.save`` shards (the default
        layout) it fails deep inside ``torch.load`` with an unpickling error that asks to file
        an issue. One small read of the first tensor's bytes tells the two apart: a
        ``torch.save`` archive starts with a zip header, a safetensors blob with its 8-byte
        header length and ``{``.

        Raises:
            CheckpointError: the checkpoint uses the safetensors serialization.
        """
        first = next((k for k, m in self.items.items() if isinstance(m, TensorMeta)), None)
        if first is None:
            return
        chunk = self.md.state_dict_metadata[first].chunks[0]
        info = self._info(_md.MetadataIndex(first, chunk.offsets))
        size = self._store.size(info.relative_path)
        if size is None or size - info.offset < 10:
            return
        head = bytearray(10)
        self._files.get(info.relative_path).read_into(info.offset, [head])
        n = struct.unpack("<Q", bytes(head[:8]))[0]
        if head[8:10] == b'{"' and info.offset + 8 + n <= size:
            raise CheckpointError(
                f"{self.uri} was saved by torch DCP with serialization_format=SAFETENSORS ({info.relative_path} holds a "
                "safetensors blob, not torch.save shards), which convert does not read (nor does torch's own "
                "FileSystemReader); save it again with the default serialization format, or with "
                "HuggingFaceStorageWriter, whose output convert reads",
                path=self.uri,
            )

    def _info(self, index: _md.MetadataIndex) -> Any:
        return storage_info(self.md, index)

    def boxes(self, key: str) -> list[Box]:
        smd = self.md.state_dict_metadata[key]
        places = self._places.get(key)
        if places is None:  # two threads may both locate a key: same answer, no harm
            places = self._places[key] = [self._locate((key, i)) for i in range(len(smd.chunks))]
        es = self.items[key].itemsize
        return [
            Box(tuple(c.offsets), tuple(c.sizes), partial(self._read, key, i, es, places[i]))
            for i, c in enumerate(smd.chunks)
        ]

    def _archive(self, key: str, i: int) -> tuple[Any, io.BufferedReader]:
        chunk = self.md.state_dict_metadata[key].chunks[i]
        info = self._info(_md.MetadataIndex(key, chunk.offsets))
        return info, io.BufferedReader(_RangeFile(self._files.get(info.relative_path), info.offset, info.length))

    def _load(self, key: str, i: int, **kw: Any) -> tuple[Any, torch.Tensor]:
        info, f = self._archive(key, i)
        check_inflation(f, f"the shard of {key!r} in {self.uri}/{info.relative_path}", key=key)
        try:
            t = torch.load(f, weights_only=True, **kw)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged archive raises many types
            raise CorruptCheckpointError(
                f"{self.uri}/{info.relative_path} bytes [{info.offset}, {info.offset + info.length}) do not decode "
                f"as the shard of {key!r} ({type(e).__name__}: {e})",
                path=info.relative_path,
                byte_range=(info.offset, info.offset + info.length),
                key=key,
            ) from None
        chunk = self.md.state_dict_metadata[key].chunks[i]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(chunk.sizes) or t.dtype != self.items[key].dtype:
            raise CorruptCheckpointError(
                f"the stored shard of {key!r} at {list(chunk.offsets)} does not match its metadata", key=key
            )
        return info, t

    def _locate(self, ref: tuple[str, int]) -> tuple[str, int] | None:
        """Where the shard's elements lie in its file, when they can be read in place.

        Loading the archive onto the meta device reads only its pickle and index; torch then
        records each storage's offset inside the archive. A contiguous shard's elements are
        one byte range there, read directly like safetensors. Otherwise ``None``: decode.
        """
        key, i = ref
        info, t = self._load(key, i, map_location="meta")
        offset = getattr(t.untyped_storage(), "_checkpoint_offset", None)
        es = t.element_size()
        end = None if offset is None else offset + (t.storage_offset() + t.numel()) * es
        if not t.is_contiguous() or not isinstance(offset, int) or offset < 0 or end > info.length:
            return None
        return info.relative_path, info.offset + offset + t.storage_offset() * es

    def _decode(self, ref: tuple[str, int]) -> memoryview:
        _, t = self._load(*ref, map_location="cpu")
        t = t.contiguous()
        return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")

    def _read(
        self, key: str, i: int, es: int, where: tuple[str, int] | None, lo: int, hi: int, out: memoryview
    ) -> None:
        if where is not None:
            name, base = where
            self._files.get(name).read_into(base + lo * es, [out])
        else:
            out[:] = self._cache.get((key, i))[lo * es : hi * es]

    def object_bytes(self, key: str) -> bytes:
        info = self._info(_md.MetadataIndex(key))
        buf = bytearray(info.length)
        self._files.get(info.relative_path).read_into(info.offset, [buf])
        return bytes(buf)

    def object_value(self, key: str) -> Any:
        return decode_torch_save(self.object_bytes(key), key, self.trust_pickle)

    def close(self) -> None:
        self._files.close()
        self._cache.clear()
        self._places.clear()


class _SinkFile(io.RawIOBase):
    """Sequential writes into a store sink, for ``torch.save``."""

    def __init__(self, sink: Any, pos: int) -> None:
        self._sink, self.pos = sink, pos

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = memoryview(b).nbytes
        if n:
            self._sink.write_at(self.pos, [b])
            self.pos += n
        return n


def write_dcp(
    source: Source,
    store: Store,
    *,
    overwrite: bool,
    thread_count: int,
    block_bytes: int = BLOCK_BYTES,
    progress: Progress = NO_PROGRESS,
) -> list[str]:
    """Write ``source`` in DCP's ``FileSystemWriter`` layout (see the module docstring).

    Raises:
        CheckpointError: a non-tensor value does not load with ``weights_only=True`` and the
            source was not opened with ``trust_pickle`` (checked before anything is written).
    """
    # Every value is decoded (weights_only unless the caller trusts the source) and encoded
    # again, never copied as stored: torch's own dcp.load unpickles these bytes without
    # restriction, so a code-executing pickle our reader refuses must not pass through.
    objects = {m.key: encode_torch_save(source.object_value(m.key)) for m in source.objects()}
    store.prepare()
    if store.read_small(METADATA_NAME) is not None:
        if not overwrite:
            raise CheckpointExistsError(f"{store.uri} already holds a DCP checkpoint; {OVERWRITE_HINT}", path=store.uri)
        store.delete(METADATA_NAME)  # first: from here on the old checkpoint is visibly incomplete
    for name in store.list():
        if _DATA_FILE.match(name):
            store.delete(name)
    sd_md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    blocks = []  # (meta, lo row, hi row)
    for meta in source.tensors():
        rows = meta.shape[0] if meta.shape else 1
        row_bytes = meta.nbytes // rows if rows and meta.numel else 0
        step = max(1, block_bytes // row_bytes) if row_bytes else max(rows, 1)
        for lo in range(0, max(rows, 1), step):
            blocks.append((meta, lo, min(rows, lo + step)))

    def read(block):
        meta, lo, hi = block
        if not meta.shape:
            t = torch.empty((), dtype=meta.dtype)
        else:
            t = torch.empty((hi - lo, *meta.shape[1:]), dtype=meta.dtype)
        if t.numel():
            row = t.numel() // max(hi - lo, 1) if meta.shape else 1
            source.read_flat(
                meta.key, lo * row, lo * row + t.numel(), memoryview(t.reshape(-1).view(torch.uint8).numpy())
            )
        return t

    sink = SequentialSink(store, DATA_NAME)
    results = ordered_map(read, blocks, threads=thread_count, ahead=2)
    progress.start(sum(m.nbytes for m in source.tensors()), "write")
    try:
        f = _SinkFile(sink, 0)
        for key, raw in objects.items():
            start = f.pos
            f.write(raw)
            sd_md[key] = _md.BytesStorageMetadata()
            storage[_md.MetadataIndex(key)] = _fs._StorageInfo(DATA_NAME, start, f.pos - start)
        chunks: dict[str, list[Any]] = {}
        for (meta, lo, _hi), t in zip(blocks, results):
            start = f.pos
            torch.save(t, f)
            offsets = torch.Size([lo] + [0] * (len(meta.shape) - 1)) if meta.shape else torch.Size([])
            chunks.setdefault(meta.key, []).append(_md.ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(t.shape)))
            storage[_md.MetadataIndex(meta.key, offsets)] = _fs._StorageInfo(DATA_NAME, start, f.pos - start)
            progress.advance(t.numel() * t.element_size())
        sink.close()
    except BaseException:
        results.close()
        sink.abort()
        raise
    finally:
        progress.close()
    for meta in source.tensors():
        sd_md[meta.key] = _md.TensorStorageMetadata(
            properties=_md.TensorProperties(dtype=meta.dtype, requires_grad=meta.requires_grad),
            size=torch.Size(meta.shape),
            chunks=chunks.get(meta.key, []),
        )
    # DCP orders state_dict_metadata as the state dict; keep the source's order.
    sd_md = {k: sd_md[k] for k in source.items}
    pd = {k: tuple(v) for k, v in source.planner_data.items() if k in sd_md} if source.planner_data else None
    md = _md.Metadata(state_dict_metadata=sd_md, planner_data=pd, storage_data=storage)
    md.version = _fs.CURRENT_DCP_VERSION
    md.storage_meta = _md.StorageMeta(checkpoint_id=None, save_id="goodput-ckpt-convert")
    store.put_commit_record(METADATA_NAME, pickle.dumps(md), replace=False)
    return [DATA_NAME, METADATA_NAME]
