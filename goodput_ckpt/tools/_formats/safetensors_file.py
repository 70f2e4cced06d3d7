"""safetensors, one file or HF-style shards, read and written through the byte stores.

The format is small enough to handle directly (an 8-byte little-endian header length, a JSON
header, then the raw bytes of each tensor), which lets both directions stream through the
:class:`~goodput_ckpt.storage.Store` interface: a tensor is read by byte ranges, never through
an mmap of the whole file, and written piece by piece after the header (:mod:`.safetensors_write`). Files written here
load with ``safetensors.torch.load_file`` and with HF ``transformers``.

Layouts:

- a single file ``NAME.safetensors`` (a destination ending in ``.safetensors``), its sidecar
  ``NAME.objects.json`` next to it;
- a directory: ``model.safetensors`` when one shard is enough, else
  ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``
  (``{"metadata": {"total_size": N}, "weight_map": {key: file}}``), and ``model.objects.json``.
"""

from __future__ import annotations

import json
import math
import posixpath
import struct
from functools import partial
from typing import Any

from ...errors import CheckpointNotFoundError, CorruptCheckpointError
from ...format.dcp_metadata import torch_dtype
from ...storage import FileSource, Store
from .base import Box, ObjectMeta, Source, TensorMeta
from .goodput import encode_torch_save
from .input_checks import read_small_capped
from .objects_json import MAX_SIDECAR_BYTES, load_sidecar

__all__ = ["SafetensorsSource", "open_safetensors", "split_file_uri"]

#: safetensors dtype names, by the goodput format's (torch's) name.
ST_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
    "complex64": "C64",
}
_FROM_ST = {v: k for k, v in ST_DTYPES.items()}
#: The safetensors spec's limit on the header.
MAX_HEADER = 100_000_000
#: An index maps keys to file names: the header's limit is ample for it.
MAX_INDEX_BYTES = MAX_HEADER
INDEX_SUFFIX = ".safetensors.index.json"
SIDECAR_SUFFIX = ".objects.json"
#: Bytes read and written per step when streaming a tensor.
PIECE_BYTES = 8 << 20


class SafetensorsSource(Source):
    """safetensors file(s) in ``store`` (``files`` in order) plus an optional sidecar."""

    format = "safetensors"

    def __init__(self, store: Store, files: list[str], sidecar: str | None) -> None:
        super().__init__()
        self.uri = store.uri if len(files) != 1 else f"{store.uri.rstrip('/')}/{files[0]}"
        self._store = store
        self._sources: dict[str, FileSource] = {}
        # key -> its stored parts: (file, absolute byte offset, offsets in the tensor, sizes). One
        # whole part, except for torch's distributed HF output (see _sharding_info).
        self._where: dict[str, list[tuple[str, int, tuple[int, ...], tuple[int, ...]]]] = {}
        self._objects: dict[str, Any] = {}
        self._partial: set[str] = set()  # keys stored as parts (torch's distributed HF output)
        try:
            for name in files:
                self._read_header(name)
            self.check_parts()
            if sidecar is not None:
                data = read_small_capped(store, sidecar, MAX_SIDECAR_BYTES, "sidecar")
                if data is not None:
                    objects, pd, md, int_keys = load_sidecar(data, f"{store.uri}/{sidecar}")
                    for key in objects:
                        if key in self.items:
                            raise CorruptCheckpointError(f"{sidecar}: {key!r} is both a tensor and an object", key=key)
                        self.items[key] = ObjectMeta(key)
                    self._objects = objects
                    self.planner_data = pd
                    self.int_keys = int_keys
                    self.metadata = md
        except BaseException:
            self.close()
            raise

    def _read_header(self, name: str) -> None:
        where = f"{self._store.uri}/{name}"
        size = self._store.size(name)
        if size is None:
            raise CorruptCheckpointError(f"safetensors file {where} is missing", path=where)
        src = self._sources[name] = self._store.open_source(name)
        if size < 8:
            raise CorruptCheckpointError(f"{where} is {size} bytes: too short for a safetensors file", path=where)
        head = bytearray(8)
        src.read_into(0, [head])
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise CorruptCheckpointError(f"{where}: header length {n} is invalid for a {size}-byte file", path=where)
        raw = bytearray(n)
        src.read_into(8, [raw])
        header = _parse_header(bytes(raw), where)
        sharding = _sharding_info(header.pop("__metadata__", None), where)
        base = 8 + n
        entries = []
        pos = 0
        for key, e in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
            begin, end = e["data_offsets"]
            meta = TensorMeta(key, torch_dtype(_FROM_ST[e["dtype"]], key), tuple(e["shape"]))
            # The reference library's rule: sorted by offsets, each tensor starts where the
            # previous one ended and holds exactly its bytes, so none overlap and none leave a gap.
            if begin != pos or end - begin != meta.nbytes:
                raise CorruptCheckpointError(
                    f"{where}: entry {key!r} ({e['dtype']} {list(meta.shape)}) has data_offsets [{begin}, {end}); expected "
                    f"[{pos}, {pos + meta.nbytes}): tensors must not overlap, leave gaps or disagree with their shape",
                    path=where,
                    key=key,
                )
            pos = end
            part_of = sharding.get(key)
            if key in self.items and (part_of is None or key not in self._partial):
                raise CorruptCheckpointError(f"{where}: key {key!r} appears in more than one file", path=where, key=key)
            if part_of is not None and len(part_of) != len(meta.shape):
                raise CorruptCheckpointError(
                    f"{where}: saved_offsets of {key!r} do not match its shape", path=where, key=key
                )
            entries.append((begin, key, meta, part_of))
        if base + pos != size:
            raise CorruptCheckpointError(
                f"{where}: the tensors cover {base + pos} of its {size} bytes; a safetensors file is exactly its header and tensors",
                path=where,
            )
        for begin, key, meta, part_of in sorted(entries, key=lambda x: x[0]):  # file order: sequential reads
            offsets = part_of or (0,) * len(meta.shape)
            self._where.setdefault(key, []).append((name, base + begin, offsets, meta.shape))
            if part_of is None:
                self.items[key] = meta
                continue
            self._partial.add(key)
            old = self.items.get(key)
            if old is not None and old.dtype != meta.dtype:
                raise CorruptCheckpointError(
                    f"{where}: the parts of {key!r} disagree on its dtype", path=where, key=key
                )
            shape = tuple(o + s for o, s in zip(offsets, meta.shape))
            if old is not None:
                shape = tuple(max(a, b) for a, b in zip(old.shape, shape))
            self.items[key] = TensorMeta(key, meta.dtype, shape)

    def check_parts(self) -> None:
        """Raise unless the parts of every partial tensor add up to it exactly once.

        Raises:
            CorruptCheckpointError: a part is missing (a rank's file absent) or repeated.
        """
        for key in self._partial:
            total = sum(math.prod(sizes) for _, _, _, sizes in self._where[key])
            if total != self.items[key].numel:
                raise CorruptCheckpointError(
                    f"{self.uri}: the partial shards of {key!r} hold {total} of its {self.items[key].numel} elements: "
                    "a rank's file of the distributed save is missing, or one is there twice",
                    key=key,
                )

    def boxes(self, key: str) -> list[Box]:
        es = self.items[key].itemsize
        return [
            Box(offsets, sizes, partial(self._read, name, offset, es))
            for name, offset, offsets, sizes in self._where[key]
        ]

    def _read(self, name: str, offset: int, es: int, lo: int, hi: int, out: memoryview) -> None:
        self._sources[name].read_into(offset + lo * es, [out])

    def object_bytes(self, key: str) -> bytes:
        return encode_torch_save(self._objects[key])

    def object_value(self, key: str) -> Any:
        return self._objects[key]

    def close(self) -> None:
        for src in self._sources.values():
            src.close()
        self._sources.clear()


def _parse_header(raw: bytes, where: str) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors header, checked as the reference library checks them.

    Why: a header the reference library refuses must not convert either. JSON that only
    Python accepts (``NaN``, ``Infinity``, a shape of ``1e400``) is refused, as are shapes and
    offsets that are not unsigned 64-bit integers (floats, strings, booleans), unknown dtypes
    and ``__metadata__`` values that are not strings.

    Raises:
        CorruptCheckpointError: anything the reference library would refuse (named).
    """

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    if not raw.startswith(b"{"):
        raise CorruptCheckpointError(f"{where}: the header does not start with '{{'", path=where)
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=constant)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: the header is not valid JSON ({e})", path=where) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: the header is not a JSON object", path=where)
    extra = header.get("__metadata__")
    if extra is not None and not (isinstance(extra, dict) and all(isinstance(v, str) for v in extra.values())):
        raise CorruptCheckpointError(f"{where}: '__metadata__' must map names to strings", path=where)
    for key, e in header.items():
        if key == "__metadata__":
            continue
        ok = (
            isinstance(e, dict)
            and e.get("dtype") in _FROM_ST
            and _u64_list(e.get("shape"))
            and _u64_list(e.get("data_offsets"))
            and len(e["data_offsets"]) == 2
            and e["data_offsets"][0] <= e["data_offsets"][1]
        )
        if not ok:
            raise CorruptCheckpointError(
                f"{where}: entry {key!r} is malformed: it needs a known 'dtype', a 'shape' of unsigned integers and "
                f"'data_offsets' of two ascending unsigned integers, got {_clip(e)}",
                path=where,
                key=key,
            )
    return header


#: Where torch's ``HuggingFaceStorageWriter(save_distributed=True)`` records each part's place.
DCP_SHARDING_KEY = "DCP_SHARDING_INFO"


def _sharding_info(extra: dict[str, str] | None, where: str) -> dict[str, tuple[int, ...]]:
    """key -> offsets in the full tensor of the parts a distributed HF save stored in this file.

    Why: with ``save_distributed=True`` every rank writes its own shard of a tensor under the
    tensor's name, in its own file, and records where the shard starts in ``__metadata__``
    (``{"DCP_SHARDING_INFO": '{"key": {"saved_offsets": [...]}}'}``); torch's reader merges
    them, and so does convert. Empty for ordinary files.

    Raises:
        CorruptCheckpointError: the sharding record is malformed.
    """
    text = (extra or {}).get(DCP_SHARDING_KEY)
    if text is None:
        return {}
    try:
        doc = json.loads(text)
        out = {k: tuple(v["saved_offsets"]) for k, v in doc.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CorruptCheckpointError(f"{where}: '{DCP_SHARDING_KEY}' is malformed ({e!r})", path=where) from None
    if not all(_u64_list(list(o)) for o in out.values()):
        raise CorruptCheckpointError(f"{where}: '{DCP_SHARDING_KEY}' offsets must be unsigned integers", path=where)
    return out


def _u64_list(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int and 0 <= x < 1 << 64 for x in v)


def _clip(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 200 else text[:200] + "..."


def split_file_uri(uri: str) -> tuple[str, str]:
    """``(parent, name)`` of a file URI (``/a/b.safetensors`` -> ``/a``, ``b.safetensors``)."""
    parent, name = posixpath.split(str(uri).rstrip("/"))
    return parent or ".", name


def open_safetensors(store: Store, single: str | None) -> SafetensorsSource:
    """Open ``single`` in ``store``, or the safetensors layout of the directory ``store``."""
    if single is not None:
        stem = single[: -len(".safetensors")] if single.endswith(".safetensors") else single
        return SafetensorsSource(store, [single], stem + SIDECAR_SUFFIX)
    names = [n for n in store.list() if "/" not in n]
    index = sorted(n for n in names if n.endswith(INDEX_SUFFIX))
    if index:
        data = read_small_capped(store, index[0], MAX_INDEX_BYTES, "safetensors index") or b""
        try:
            weight_map = json.loads(data.decode("utf-8"))["weight_map"]
            files = list(dict.fromkeys(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"{store.uri}/{index[0]} is not a valid index ({e!r})", path=index[0]
            ) from None
        stem = index[0][: -len(INDEX_SUFFIX)]
    else:
        files = sorted(n for n in names if n.endswith(".safetensors"))
        if not files:
            raise CheckpointNotFoundError(f"no .safetensors files in {store.uri}", path=store.uri)
        stem = files[0][: -len(".safetensors")] if len(files) == 1 else "model"
    return SafetensorsSource(store, files, stem + SIDECAR_SUFFIX)
