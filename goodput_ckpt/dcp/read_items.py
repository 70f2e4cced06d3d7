"""DCP read items to byte-range requests and back: the per-item half of ``CheckpointReader``.

``CheckpointReader.read_data`` gets a ``LoadPlan`` of ``ReadItem``\\ s. For each, this module
works out which bytes of which file it needs (:func:`item_request`: a tensor's covering range
of its saved chunk, or an object's whole value) and, once those bytes are read and checked,
hands the result to the planner (:func:`finish`): a tensor copied (or already read in place)
into its destination, an object decoded safely. The reader's other half (``dcp/reader.py``)
plans, runs and verifies the reads; this split keeps each under 400 lines and gives the one
``torch.load`` on the load path (:func:`decode_object`) a module that says what it trusts.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ..engine.read_plan import Request
from ..engine.untrusted_load import check_inflation, weights_only_refusal
from ..errors import CheckpointError
from ..format.dcp_metadata import StoredRange, torch_dtype
from ..format.manifest import DTYPE_SIZES, Manifest, ObjectEntry, TensorEntry
from .tensor_bytes import byte_view

__all__ = ["ObjectJob", "TensorJob", "decode_object", "finish", "item_request", "load_value"]


@dataclass(eq=False)
class TensorJob:
    """A tensor item's read: where it lands and, when the file bytes cannot land there directly
    (another device, layout or dtype, or a strided sub-range), the staging buffer they land in."""

    item: ReadItem
    region: torch.Tensor
    dtype: torch.dtype
    numel: int  # elements in the covering range read from the file
    strides: tuple[int, ...]
    staging: torch.Tensor | None = None


@dataclass(eq=False)
class ObjectJob:
    """A non-tensor item's read: its whole stored value, decoded by :func:`decode_object`."""

    item: ReadItem


def item_request(
    manifest: Manifest,
    item: ReadItem,
    loc: StoredRange,
    planner: LoadPlanner,
    chunk_index: Callable[[TensorEntry], Any],
    done: Callable[[Request], None],
) -> Request | None:
    """The byte range ``item`` needs from its file, or ``None`` when it needs none (an empty
    tensor or value, finished at once through ``done``).

    ``chunk_index`` finds an entry's saved chunk by its offsets (the reader caches it per key).
    A tensor whose destination is contiguous CPU memory of the stored dtype gets a zero-copy
    buffer over that memory; others are staged by the reader when their first part is read.

    Raises:
        CheckpointError: the tensor has no saved chunk at the item's offsets, or the planner's
            destination does not have the item's shape.
    """
    key = item.storage_index.fqn
    entry = manifest.items.get(key)
    if isinstance(entry, ObjectEntry) or entry is None:
        req = Request(loc.file, loc.offset, loc.offset + loc.length, ObjectJob(item))
        req.buffer = memoryview(bytearray(loc.length))
        if loc.length == 0:
            done(req)
            return None
        return req
    dtype = torch_dtype(entry.dtype, key)
    chunk = chunk_index(entry).get(tuple(item.storage_index.offset or ()))
    if chunk is None:
        raise CheckpointError(
            f"tensor {key!r} has no saved chunk at offsets {tuple(item.storage_index.offset or ())}", key=key
        )
    strides = c_strides(chunk.sizes)
    lengths = tuple(item.lengths)
    numel = math.prod(lengths)
    region = planner.resolve_tensor(item).detach()
    if tuple(region.shape) != lengths:
        raise CheckpointError(
            f"tensor {key!r}: the planner's destination has shape {tuple(region.shape)}, expected {lengths}",
            key=key,
        )
    first = sum(o * s for o, s in zip(item.storage_offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(item.storage_offsets, lengths, strides)) if numel else first - 1
    es = DTYPE_SIZES[entry.dtype]
    job = TensorJob(item, region, dtype, last - first + 1, strides)
    req = Request(loc.file, loc.offset + first * es, loc.offset + (last + 1) * es, job)
    if numel == 0:
        done(req)
        return None
    if region.device.type == "cpu" and region.is_contiguous() and region.dtype == dtype and job.numel == numel:
        req.buffer = byte_view(region)  # zero copy: the file bytes land in the destination
    return req


#: How a reader's user trusts a checkpoint, named in a ``weights_only`` refusal.
_READER_OPT_IN = "CheckpointReader(..., trust_pickle=True)"


def finish(req: Request, planner: LoadPlanner, *, trust_pickle: bool) -> None:
    """Hand a fully read (and verified) request's result to the planner and drop its buffers.

    A non-tensor value goes to a planner with a ``load_decoded(item, value)`` method
    (``GridLoadPlanner``) as the object ``torch.load(weights_only=True)`` decoded; any other
    planner gets it through ``load_bytes``, which unpickles without restriction, as bytes
    :func:`decode_object` re-serialized from that object."""
    job = req.item
    if isinstance(job, ObjectJob):
        key = job.item.storage_index.fqn
        load_decoded = None if trust_pickle else getattr(planner, "load_decoded", None)
        if load_decoded is not None:  # our planner takes the value itself: no torch.save and reload
            load_decoded(job.item, load_value(bytes(req.buffer), key, trust_pickle=False, opt_in=_READER_OPT_IN))
        else:
            planner.load_bytes(job.item, decode_object(key, bytes(req.buffer), trust_pickle))
        req.buffer = None
        return
    if job.staging is not None:
        src = torch.as_strided(job.staging, tuple(job.item.lengths), job.strides)
        job.region.copy_(src)
        job.staging = None
    req.buffer = None
    planner.commit_tensor(job.item, job.region)


def decode_object(key: str, raw: bytes, trust_pickle: bool) -> io.BytesIO:
    """Bytes for ``planner.load_bytes``, which unpickles without restriction.

    The stored bytes are decoded with ``weights_only=True`` and re-serialized, so the
    planner only ever unpickles bytes produced here from an allow-listed object.

    Raises:
        CheckpointError: the value inflates past the guard, or ``weights_only`` refuses it
            (naming why, and the ``trust_pickle=True`` opt-in).
    """
    if trust_pickle:
        check_inflation(raw, f"value {key!r}", key=key)
        return io.BytesIO(raw)
    obj = load_value(raw, key, trust_pickle=False, opt_in=_READER_OPT_IN)
    out = io.BytesIO()
    torch.save(obj, out)
    out.seek(0)
    return out


def load_value(raw: bytes, key: str, *, trust_pickle: bool, opt_in: str, map_location: Any = None) -> Any:
    """A stored ``torch.save`` value, decoded with ``torch.load(weights_only=True)`` unless the
    caller trusts the checkpoint: the one rule for the reader and the converters' goodput source.

    Args:
        opt_in: how the caller's user trusts a checkpoint, named in the refusal (an argument, a
            command-line flag).

    Raises:
        CheckpointError: the value inflates past the guard, ``weights_only`` refuses it (naming
            why and ``opt_in``), or, trusted, it cannot be unpickled at all.
    """
    check_inflation(raw, f"value {key!r}", key=key)
    try:
        return torch.load(io.BytesIO(raw), weights_only=not trust_pickle, map_location=map_location)
    except Exception as e:  # noqa: BLE001 - the unpickler raises many types
        if trust_pickle:
            raise CheckpointError(f"value {key!r} cannot be decoded: {type(e).__name__}: {e}", key=key) from e
        raise CheckpointError(
            f"value {key!r} cannot be loaded safely with weights_only=True "
            f"({weights_only_refusal(e)}). If you trust this checkpoint, pass {opt_in}.",
            key=key,
        ) from None


def c_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """C-order strides of a saved chunk of ``sizes`` (a zero-size dim counted as 1)."""
    strides = []
    acc = 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))
