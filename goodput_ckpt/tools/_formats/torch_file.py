"""A single ``torch.save`` file (a local path), read and written with bounded memory.

Reading. ``torch.load(mmap=True, weights_only=True)`` maps the archive instead of reading it,
so loading the structure costs nothing. Tensors are then read by ranges through the mapping;
after each range the process gives the mapped pages back (``madvise(MADV_DONTNEED)`` on Linux;
they stay in the page cache), so resident memory stays at a few ranges instead of growing to
the file size. The nested state dict is flattened with DCP's own flattening, so keys and
``planner_data`` match what ``dcp.save`` would produce. Files in torch's legacy (non-zip)
format cannot be mapped and are loaded whole (memory: the file size). ``trust_pickle`` turns
``weights_only`` off.

Writing. The archive is laid out without any tensor data: ``torch.save`` runs under
``torch.serialization.skip_data`` on placeholder tensors of the right dtypes and shapes, which
writes the pickle and reserves each storage's bytes without reading them. The placeholders are
``torch.empty`` tensors (never touched, so no memory becomes resident) while they total at most
:data:`REAL_PLACEHOLDER_BYTES`; above that, fake tensors (``FakeTensorMode``), which allocate
nothing at all but cost importing ``torch._dynamo`` on first use: 1.4 s on a quiet machine and
2.5-3.7 s on the loaded 2-core development machine, which was the whole time of converting a
128-byte checkpoint. Both give the same archive layout and values. Then the bytes are filled in place, piece by
piece, at the offsets the archive's index gives, and the file is renamed into place. Memory
stays at a few pieces. The result loads with plain ``torch.load``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import sys
import zipfile
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from ...engine.untrusted_load import check_inflation, weights_only_refusal
from ...errors import (
    OVERWRITE_HINT,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from .._common import NO_PROGRESS, Progress
from .base import Box, LoadingCache, ObjectMeta, Source, TensorMeta, alloc, ordered_map
from .goodput import encode_torch_save
from .key_types import find_int_keys, nest

__all__ = ["TorchSource", "write_torch"]

PIECE_BYTES = 8 << 20
#: Largest total of real (``torch.empty``, never touched) placeholders; larger sources use fake
#: tensors (module docstring). At this size the virtual allocation is harmless even where the
#: kernel does not overcommit, and the import's second or two is small beside writing it.
REAL_PLACEHOLDER_BYTES = 1 << 30
_MADV_DONTNEED = 4
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover
        _libc = None


def _drop_pages(addr: int, nbytes: int) -> None:
    """Unmap the whole pages inside ``[addr, addr + nbytes)`` of a read-only file mapping.

    Only pages entirely inside the range are dropped; the next access re-reads them from the
    page cache, so this is safe for a mapping nobody writes to.
    """
    if _libc is None or nbytes <= 0:
        return
    page = mmap.PAGESIZE
    start = -(-addr // page) * page
    end = (addr + nbytes) // page * page
    if end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


class TorchSource(Source):
    """A ``torch.save`` file holding a (nested) state dict."""

    format = "torch"

    def __init__(self, path: str, *, trust_pickle: bool = False) -> None:
        super().__init__()
        self.uri = path
        if not os.path.isfile(path):
            raise CheckpointNotFoundError(f"no file at {path}", path=path)
        self.trust_pickle = trust_pickle
        self._mapped = zipfile.is_zipfile(path)
        check_inflation(path, path)
        try:
            obj = torch.load(path, mmap=self._mapped, weights_only=not trust_pickle, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - the unpickler raises many types
            if not trust_pickle and "weights_only" in str(e):
                raise CheckpointError(
                    f"{path} cannot be loaded safely with weights_only=True ({weights_only_refusal(e)}). "
                    "If you trust this file, pass --trust-pickle (trust_pickle=True).",
                    path=path,
                ) from None
            raise CorruptCheckpointError(
                f"{path} is not a loadable torch.save file ({type(e).__name__}: {e})", path=path
            ) from None
        if not isinstance(obj, Mapping):
            raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a state dict (a mapping)", path=path)
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        try:
            flat, mapping = flatten_state_dict(dict(obj))
        except ValueError as e:  # two keys with one spelling, such as 0 and "0"
            raise CheckpointError(
                f"{path}: {e}; convert needs distinct names for the keys of a mapping", path=path
            ) from None
        self._flat: dict[str, Any] = {}
        for key, v in flat.items():
            if isinstance(v, torch.Tensor):
                if type(v) is not torch.Tensor or v.layout != torch.strided or v.is_quantized:
                    raise CheckpointError(
                        f"{key!r} is a {type(v).__name__} ({v.layout}); convert reads plain dense tensors", key=key
                    )
                self.items[key] = TensorMeta(key, v.dtype, tuple(v.shape), bool(v.requires_grad))
                self._flat[key] = v.detach()
            else:
                self.items[key] = ObjectMeta(key)
                self._flat[key] = v
        self.planner_data = {k: list(p) for k, p in mapping.items()}
        self.int_keys = find_int_keys(obj, mapping)
        # A non-contiguous tensor is made contiguous once, for all its ranges.
        self._contiguous = LoadingCache(1, lambda key: self._flat[key].contiguous())

    def boxes(self, key: str) -> list[Box]:
        meta = self.items[key]
        return [Box((0,) * len(meta.shape), tuple(meta.shape), partial(self._read, key))]

    def _read(self, key: str, lo: int, hi: int, out: memoryview) -> None:
        t = self._flat[key]
        mapped = self._mapped and t.is_contiguous()
        if not t.is_contiguous():
            t = self._contiguous.get(key)
        src = t.reshape(-1)[lo:hi]
        if src.numel() == 0:
            return
        torch.frombuffer(out, dtype=torch.uint8).copy_(src.view(torch.uint8))
        if mapped:
            _drop_pages(src.data_ptr(), src.numel() * src.element_size())

    def object_bytes(self, key: str) -> bytes:
        return encode_torch_save(self._flat[key])

    def object_value(self, key: str) -> Any:
        return self._flat[key]

    def close(self) -> None:
        self._flat = {}
        self._contiguous.clear()


def _tensor_order(obj: Any, out: list[int]) -> None:
    """Ids of the tensors in ``obj`` in the order pickle meets them (depth first)."""
    if isinstance(obj, torch.Tensor):
        out.append(id(obj))
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _tensor_order(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensor_order(v, out)


def write_torch(
    source: Source,
    path: str,
    *,
    overwrite: bool,
    thread_count: int,
    progress: Progress = NO_PROGRESS,
) -> list[str]:
    """Write ``source`` as one ``torch.save`` file at the local ``path`` (module docstring)."""
    from torch.serialization import skip_data

    if os.path.exists(path) and not overwrite:
        raise CheckpointExistsError(f"{path} exists; {OVERWRITE_HINT}", path=path)
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a directory; the torch format is a single file", path=path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    flat: dict[str, Any] = {}
    fakes: dict[int, TensorMeta] = {}
    with _placeholder_mode(source.tensors()):
        for key, meta in source.items.items():
            if isinstance(meta, TensorMeta):
                t = torch.empty(meta.shape, dtype=meta.dtype)
                flat[key] = t
                fakes[id(t)] = meta
    for obj in source.objects():
        flat[obj.key] = source.object_value(obj.key)
    flat = {k: flat[k] for k in source.items}
    pd = source.planner_data
    nested = nest(flat, pd, source.int_keys) if pd and set(pd) == set(flat) else flat
    order: list[int] = []
    _tensor_order(nested, order)
    if any(i not in fakes for i in order):
        # skip_data would leave those tensors' bytes unwritten.
        raise CheckpointError("a non-tensor value of the source holds tensors; the torch writer cannot stream it")
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{secrets.token_hex(6)}")
    try:
        with skip_data(materialize_fake_tensors=True):
            torch.save(nested, tmp)
        metas = [fakes[i] for i in order]
        offsets = _storage_offsets(tmp, metas)
        del nested, flat
        pieces = []
        for meta, base in zip(metas, offsets):
            step = max(1, PIECE_BYTES // meta.itemsize)
            for lo in range(0, meta.numel, step):
                pieces.append((meta, lo, min(meta.numel, lo + step), base + lo * meta.itemsize))
        fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
        progress.start(sum(m.nbytes for m in metas), "write")
        try:

            def fill(piece) -> int:
                meta, lo, hi, at = piece
                buf = alloc((hi - lo) * meta.itemsize)
                source.read_flat(meta.key, lo, hi, buf)
                view = buf
                while view:
                    view = view[os.pwrite(fd, view, at + buf.nbytes - view.nbytes) :]
                return buf.nbytes

            for n in ordered_map(fill, pieces, threads=thread_count, ahead=2 * thread_count):
                progress.advance(n)
            os.fsync(fd)
        finally:
            os.close(fd)
            progress.close()
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if someone created ``path`` meanwhile
            os.unlink(tmp)
    except FileExistsError as e:
        raise CheckpointExistsError(f"{path} appeared while converting; nothing was overwritten", path=path) from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return [path]


def _placeholder_mode(tensors: list[TensorMeta]) -> Any:
    """The context the placeholders are made in: none (real, untouched ``torch.empty``) for a
    small source, ``FakeTensorMode`` for a large one or where ``torch.empty`` would fill its
    memory (deterministic mode's ``fill_uninitialized_memory``)."""
    import contextlib

    import torch.utils.deterministic

    fills = torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
    if sum(t.nbytes for t in tensors) <= REAL_PLACEHOLDER_BYTES and not fills:
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def _storage_offsets(path: str, metas: list[TensorMeta]) -> list[int]:
    """Byte offsets of the storages ``data/0 .. data/N-1`` in the archive, checked against
    the tensors they must hold (pickle order), so a change in torch's layout fails loudly."""
    with zipfile.ZipFile(path) as z:
        records = {}
        for info in z.infolist():
            parts = info.filename.split("/")
            if len(parts) == 3 and parts[1] == "data" and parts[2].isdigit():
                records[int(parts[2])] = info
        if sorted(records) != list(range(len(metas))):
            raise CheckpointError(
                f"torch {torch.__version__} laid out {len(records)} storages for {len(metas)} tensors; cannot fill them"
            )
        out = []
        with open(path, "rb") as f:
            for i, meta in enumerate(metas):
                info = records[i]
                if info.file_size != meta.nbytes or info.compress_type != zipfile.ZIP_STORED:
                    raise CheckpointError(
                        f"storage data/{i} of {path} does not match tensor {meta.key!r}; cannot fill it"
                    )
                f.seek(info.header_offset + 26)
                name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
                out.append(info.header_offset + 30 + name_len + extra_len)
    return out
