"""What the converters share: a checkpoint seen as ordered items whose tensors are read by range.

Every input format is opened as a :class:`Source`: an ordered mapping of keys to tensors
(dtype, global shape) and non-tensor objects, plus, for each tensor, the *boxes* it was saved
as (a whole tensor, or shards: offsets and sizes in the global tensor) with a function that
reads a contiguous element range of a box.

Writers never ask for a whole tensor. They ask for *flat ranges*: elements ``[lo, hi)`` of the
global tensor in C order, a few MiB at a time. :func:`flat_pieces` cuts such a range into
sub-boxes that are contiguous both in the global tensor and in every stored box they meet, so
every piece is one ranged read, straight into the destination buffer when the box spans the
full trailing dimensions (the usual dim-0 sharding) and through a small staging copy otherwise.
That is what keeps conversion memory at a few chunks whatever the tensor size.
"""

from __future__ import annotations

import math
import mmap
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ...errors import CorruptCheckpointError

__all__ = [
    "Box",
    "alloc",
    "LoadingCache",
    "ObjectMeta",
    "Source",
    "TensorMeta",
    "c_strides",
    "flat_pieces",
    "ordered_map",
    "read_flat",
]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class TensorMeta:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class ObjectMeta:
    key: str


@dataclass(frozen=True)
class Box:
    """One stored piece of a tensor.

    ``read(lo, hi, out)`` fills the writable byte buffer ``out`` with elements ``[lo, hi)`` of
    the box in its own C order. It must be safe to call from several threads.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    read: Callable[[int, int, memoryview], None]


class OpenFiles:
    """A store's data files, each opened once on first use and shared by every reader thread
    (a ``FileSource`` is thread-safe); :meth:`close` closes them all."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._open: dict[str, Any] = {}
        self._lock = threading.Lock()  # worker threads open files lazily

    def get(self, name: str) -> Any:
        with self._lock:
            src = self._open.get(name)
            if src is None:
                src = self._open[name] = self._store.open_source(name)
            return src

    def close(self) -> None:
        with self._lock:
            opened, self._open = list(self._open.values()), {}
        for src in opened:
            src.close()


class Source(ABC):
    """An open input checkpoint of any format (see the module docstring).

    Attributes:
        format: ``goodput``, ``dcp``, ``torch`` or ``safetensors``.
        uri: where it is, for messages.
        items: key -> :class:`TensorMeta` or :class:`ObjectMeta`, in the source's order.
        planner_data: key -> path in the nested state dict (DCP's flattening), or ``None``
            when the source is flat.
        int_keys: key -> positions of its ``planner_data`` path that were integer mapping
            keys (:mod:`goodput_ckpt.format.nesting`); empty when all were strings.
        metadata: user metadata carried along (JSON).
        world_size: ranks that wrote it, when known.
    """

    format: str = ""
    uri: str = ""
    world_size: int | None = None

    def __init__(self) -> None:
        self.items: dict[str, TensorMeta | ObjectMeta] = {}
        self.planner_data: dict[str, list[Any]] | None = None
        self.int_keys: dict[str, list[int]] = {}
        self.metadata: dict[str, Any] = {}

    @abstractmethod
    def boxes(self, key: str) -> Sequence[Box]:
        """The stored pieces of tensor ``key``."""

    @abstractmethod
    def object_bytes(self, key: str) -> bytes:
        """Object ``key`` in the ``torch.save`` encoding of the goodput format (no unpickling needed
        where the source already stores it that way)."""

    @abstractmethod
    def object_value(self, key: str) -> Any:
        """Object ``key`` decoded (restricted unpickling unless the caller trusted pickle)."""

    def read_flat(self, key: str, lo: int, hi: int, out: memoryview) -> None:
        """Fill ``out`` with elements ``[lo, hi)`` of tensor ``key`` (global C order)."""
        meta = self.items[key]
        if not isinstance(meta, TensorMeta):
            raise TypeError(f"{key!r} is not a tensor")
        read_flat(meta, self.boxes(key), lo, hi, out)

    def tensors(self) -> list[TensorMeta]:
        return [m for m in self.items.values() if isinstance(m, TensorMeta)]

    def objects(self) -> list[ObjectMeta]:
        return [m for m in self.items.values() if isinstance(m, ObjectMeta)]

    def close(self) -> None:  # noqa: B027 - optional hook: sources holding no files need not close
        """Release files and caches. Idempotent."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def alloc(n: int) -> memoryview:
    """A writable, zeroed buffer of ``n`` bytes.

    Why: buffers of a MiB and more are anonymous mappings, returned to the system as soon as
    they are dropped. From malloc, freed blocks of this size stay in its per-thread arenas
    (its mmap threshold rises after the first free), and resident memory drifts well above the
    few chunks that are actually live.
    """
    if n >= 1 << 20:
        return memoryview(mmap.mmap(-1, n))
    return memoryview(bytearray(n))


def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-order array of ``shape``."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * max(shape[d + 1], 1)
    return tuple(out)


def flat_pieces(shape: Sequence[int], lo: int, hi: int) -> list[tuple[tuple[int, ...], int, int, int]]:
    """Cut elements ``[lo, hi)`` of a C-order tensor into at most ``2 * ndim - 1`` pieces.

    A piece ``(prefix, dim, a, b)`` fixes the indices of the dimensions before ``dim`` to
    ``prefix``, takes ``[a, b)`` along ``dim`` and everything along the later dimensions.
    Pieces come in order and are contiguous, both in the tensor and in any box they meet.
    """
    shape = tuple(shape) or (1,)
    strides = c_strides(shape)
    out: list[tuple[tuple[int, ...], int, int, int]] = []

    def rec(d: int, prefix: tuple[int, ...], lo: int, hi: int) -> None:
        st = strides[d]
        i0, r0 = divmod(lo, st)
        i1, r1 = divmod(hi, st)
        if i0 == i1:
            rec(d + 1, prefix + (i0,), r0, r1)
            return
        if r0:
            rec(d + 1, prefix + (i0,), r0, st)
            i0 += 1
        if i1 > i0:
            out.append((prefix, d, i0, i1))
        if r1:
            rec(d + 1, prefix + (i1,), 0, r1)

    if lo < hi:
        rec(0, (), lo, hi)
    return out


def read_flat(meta: TensorMeta, boxes: Sequence[Box], lo: int, hi: int, out: memoryview) -> None:
    """Fill ``out`` with elements ``[lo, hi)`` of ``meta``'s tensor from its stored ``boxes``.

    Raises:
        CorruptCheckpointError: part of the range lies in no box.
    """
    es = meta.itemsize
    shape = meta.shape or (1,)
    boxes = [b if meta.shape else Box((0,), (1,), b.read) for b in boxes]
    strides = c_strides(shape)
    pos = lo
    for prefix, d, a, b in flat_pieces(shape, lo, hi):
        n = (b - a) * strides[d]
        piece = out[(pos - lo) * es : (pos - lo + n) * es]
        covered = 0
        for box in boxes:
            o, s = box.offsets, box.sizes
            if any(not o[i] <= prefix[i] < o[i] + s[i] for i in range(d)):
                continue
            ra, rb = max(a, o[d]), min(b, o[d] + s[d])
            if ra >= rb:
                continue
            cs = c_strides(s)
            start = sum((prefix[i] - o[i]) * cs[i] for i in range(d)) + (ra - o[d]) * cs[d]
            count = (rb - ra) * cs[d]
            if count == 0:
                continue
            if all(o[j] == 0 and s[j] == shape[j] for j in range(d + 1, len(shape))):
                # The box spans the trailing dims: its bytes land contiguously in the piece.
                dst = piece[(ra - a) * strides[d] * es : (rb - a) * strides[d] * es]
                box.read(start, start + count, dst)
            else:
                tmp = bytearray(count * es)
                box.read(start, start + count, memoryview(tmp))
                _scatter(piece, shape[d + 1 :], b - a, tmp, s[d + 1 :], o[d + 1 :], ra - a, rb - ra, es)
            covered += count
        if covered != n:
            raise CorruptCheckpointError(
                f"tensor {meta.key!r}: elements [{pos}, {pos + n}) are not covered by exactly one "
                f"stored piece ({covered} of {n} found); the checkpoint's chunk list is inconsistent",
                key=meta.key,
            )
        pos += n


def _scatter(piece, trailing, rows, tmp, box_trailing, box_offsets, row0, nrows, es) -> None:
    """Copy a box's rows (``tmp``) into the piece at their place in the trailing dims."""
    dst = torch.frombuffer(piece, dtype=torch.uint8).view(rows, *trailing[:-1], trailing[-1] * es)
    src = torch.frombuffer(tmp, dtype=torch.uint8).view(nrows, *box_trailing[:-1], box_trailing[-1] * es)
    index = [slice(row0, row0 + nrows)]
    index += [slice(o, o + s) for o, s in zip(box_offsets[:-1], box_trailing[:-1])]
    index.append(slice(box_offsets[-1] * es, (box_offsets[-1] + box_trailing[-1]) * es))
    dst[tuple(index)].copy_(src)


class LoadingCache:
    """A small LRU of loaded values, with concurrent loads of one key done once.

    Why: converting reads neighbouring ranges from several threads. A value (a verified hash
    chunk, a decoded DCP shard) is costly to load, and the next range usually needs the same
    one; without the cache each would be read and hashed twice, and without the in-flight
    table two threads would load it at the same time. ``capacity`` bounds the memory.
    """

    def __init__(self, capacity: int, load: Callable[[Any], Any]) -> None:
        self._capacity = max(1, capacity)
        self._load = load
        self._lock = threading.Lock()  # guards _values and _loading
        self._values: OrderedDict[Any, Any] = OrderedDict()
        self._loading: dict[Any, _Pending] = {}

    def get(self, key: Any) -> Any:
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
            pending = self._loading.get(key)
            owner = pending is None
            if owner:
                pending = self._loading[key] = _Pending()
        if not owner:
            return pending.wait()
        try:
            value = self._load(key)
        except BaseException as e:
            with self._lock:
                self._loading.pop(key, None)
            pending.fail(e)
            raise
        with self._lock:
            self._loading.pop(key, None)
            self._values[key] = value
            while len(self._values) > self._capacity:
                self._values.popitem(last=False)
        pending.done(value)
        return value

    def clear(self) -> None:
        with self._lock:
            self._values.clear()


class _Pending:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self, value: Any) -> None:
        self._value = value
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def wait(self) -> Any:
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value


def ordered_map(fn: Callable[[T], R], items: Iterable[T], *, threads: int, ahead: int) -> Iterator[R]:
    """``map(fn, items)`` on a pool, results in order, at most ``ahead`` computed in advance.

    Used where the output must be written in order (a safetensors file, a DCP ``.distcp``
    file, a volume) while its pieces are read in parallel; ``ahead`` bounds the memory.
    """
    with ThreadPoolExecutor(threads, thread_name_prefix="goodput-convert") as pool:
        pending: deque = deque()
        try:
            for x in items:
                pending.append(pool.submit(fn, x))
                if len(pending) >= ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()
