"""Where a rank's bytes come from while ``CheckpointWriter.write_data`` writes them: each planned
item resolved through the planner to a tensor's bytes (checked against its plan) or a serialized
object's bytes (checked to load with ``weights_only=True``).

Why apart from the writer: the writer is DCP's protocol, called in DCP's order; what one item's
bytes are, and which of them are refused, is one rule of its own.
"""

from __future__ import annotations

import io
import threading
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from ..engine.layout import ShardShape
from ..errors import CheckpointError
from ..format.dcp_metadata import dtype_name
from ..format.manifest import DTYPE_SIZES
from .tensor_bytes import TensorByteSource

__all__ = ["BytesSource", "resolve_item", "save_world_size", "shard_shape"]


def shard_shape(item: WriteItem) -> ShardShape | None:
    """What the byte layout needs of a shard item (``engine/layout.py``: its slot), or ``None``
    for an item without tensor data."""
    data = item.tensor_data
    if data is None:
        return None
    chunk = data.chunk
    return ShardShape(tuple(data.size), tuple(chunk.offsets), tuple(chunk.sizes), data.properties.dtype.itemsize)


def save_world_size() -> int:
    """The ranks a distributed tensor's shards are cut for, as far as a rank knows it at write
    time: the default group's size (1 without ``torch.distributed``). Only a layout hint: where
    a tensor is cut otherwise (a sub-mesh), its shards keep their own sizes
    (:func:`~goodput_ckpt.engine.layout.shard_slot`)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def resolve_item(item: WriteItem, planner: SavePlanner) -> Any:
    """The byte source of ``item``: a :class:`LazyTensorSource` for a tensor item (its size is
    its plan's), a :class:`BytesSource` for a serialized value (serialized now: its size is only
    known then).

    Raises:
        CheckpointError: the item's dtype has no name in the format.
    """
    if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
        return LazyTensorSource(item, planner)
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        _warn_if_unsafe_object(raw, item.index.fqn)
        return BytesSource(raw)
    return _tensor_source(item, data)


class LazyTensorSource:
    """A tensor item's bytes, resolved through the planner at the first range asked for.

    Why lazy: resolving costs about 37 us an item (torch's lookup through the state dict, the
    byte view's checks), 18 ms of a 501-tensor save's serial time before any byte moved; the
    writer threads ask for ranges in file order, so each item is resolved there, beside the I/O
    of the chunks before it. The size comes from the plan, which the resolved tensor must match.
    """

    def __init__(self, item: WriteItem, planner: SavePlanner) -> None:
        self.nbytes = _planned_nbytes(item)
        self._item: WriteItem | None = item
        self._planner: SavePlanner | None = planner
        self._source: TensorByteSource | None = None
        self._lock = threading.Lock()

    def _resolve(self) -> TensorByteSource:
        with self._lock:
            if self._source is None:
                assert self._item is not None and self._planner is not None, "source used after release"
                self._source = _tensor_source(self._item, self._planner.resolve_data(self._item))
            return self._source

    def view(self, start: int, end: int) -> Any:
        source = self._source
        return (source if source is not None else self._resolve()).view(start, end)

    def release(self) -> None:
        with self._lock:
            source, self._source = self._source, None
            self._item = self._planner = None
        if source is not None:
            source.release()


def _planned_nbytes(item: WriteItem) -> int:
    """The bytes a tensor item's plan gives it (its chunk's elements times its dtype's size).

    Raises:
        CheckpointError: the dtype has no name in the format.
    """
    td = item.tensor_data
    assert td is not None
    return _numel(td.chunk.sizes) * DTYPE_SIZES[dtype_name(td.properties.dtype, item.index.fqn)]


def _tensor_source(item: WriteItem, data: Any) -> TensorByteSource:
    """``data`` as the byte source of tensor item ``item``.

    Raises:
        CheckpointError: the planner resolved something that is not a tensor for a tensor item,
            or a tensor whose dtype or size differs from its plan.
    """
    key = item.index.fqn
    if not isinstance(data, torch.Tensor):
        raise CheckpointError(f"item {key!r}: the planner resolved a {type(data).__name__}, not a tensor", key=key)
    src = TensorByteSource(data, key)
    td = item.tensor_data
    if td is not None:
        expected = _planned_nbytes(item)
        if src.nbytes != expected or data.dtype != td.properties.dtype:
            raise CheckpointError(
                f"tensor {key!r}: data ({data.dtype}, {src.nbytes} bytes) does not match its plan "
                f"({td.properties.dtype}, {expected} bytes)",
                key=key,
            )
    return src


class BytesSource:
    """Serialized non-tensor value: served from memory."""

    def __init__(self, raw: bytes) -> None:
        self._view = memoryview(raw)
        self.nbytes = len(raw)

    def view(self, start: int, end: int) -> memoryview:
        return self._view[start:end]

    def release(self) -> None:
        pass


def _warn_if_unsafe_object(raw: bytes, key: str) -> None:
    """Warn at save time when a value will not load with ``weights_only=True``."""
    try:
        torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
        warnings.warn(
            f"state-dict value {key!r} cannot be loaded with weights_only=True ({type(e).__name__}: "
            f"{str(e)[:200]}); loading it will need CheckpointReader(..., trust_pickle=True). "
            "Store plain Python types or tensors instead.",
            stacklevel=4,
        )


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n
