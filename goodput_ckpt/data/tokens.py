"""``TokenStream``: a resumable, reshardable stream of fixed-length token sequences over shard files.

LLM pretraining reads packed token shards: flat files of ``uint16`` or ``uint32`` tokens, cut
here into sequences of ``seq_len`` tokens (a shard's trailing partial sequence is not read).
Shards are read through this project's storage layer (``open_store``: local disk, a mounted
volume, ``s3://`` with ranged reads and retries), in blocks of ``block`` sequences, up to
``read_ahead`` blocks read ahead across shard boundaries and ``blocks_per_request`` consecutive
blocks per request, into reused buffers (:mod:`._blocks`).
It yields one tensor per sequence, or with ``batch_size`` one ``(batch_size, seq_len)`` tensor
per batch: at 8 KiB sequences the Python cost of one item per sequence (about 1 us) is more than
reading the sequence from the page cache, so a loader that batches should take whole batches
(``DataLoader(stream, batch_size=None)``).

**Who reads what.** Shards still unfinished at the start of a stretch are dealt round-robin over
the (rank, worker) pairs of the current topology; each pair reads its shards one after another,
each from where the stretch found it. A shard has one reader per stretch, so what was read of it
is always a prefix.

**State.** Each worker's ``state_dict()`` (taken by ``StatefulDataLoader`` with every yielded
batch, so prefetched batches are not counted) holds the per-shard counts at the start of the
stretch (``base``), how far it got in its own shards (``progress``), and each shard's size, so
that a shard replaced under its name is refused (:mod:`._token_state`). Same topology: the loader
hands each worker its own state back. Another world size or worker count: the manager's restore
hands every old rank's loader state to :meth:`TokenStream.elastic_resume`, which takes, per shard,
the furthest count any old reader reached, as the new ``base``; the new (rank, worker) pairs then
split the unfinished shards. No sequence is read twice, none is skipped.

What the state costs: a reader's ``state_dict()`` holds the shard names, every shard's base count
and size (about 18 bytes per shard pickled, plus the names) and its own shards' counts. A
``CheckpointManager`` save stores what every reader shares once per job, in the commit record
(JSON: the names, plus about 17 bytes per shard), and each reader's row keeps only its own
shards' counts (about 10 bytes per shard it reads) and a digest (:mod:`._token_state`): the
job's loader state is O(shards + readers), not O(ranks x workers x shards), and does not grow
with restarts. An elastic restore checks the shared part once, then each reader's own counts.

Keep ``snapshot_every_n_steps`` at 1 (the default): with larger values the loader's worker
snapshots lag, and an elastic restore would read a few sequences again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import CheckpointError
from ..storage import open_store
from ._blocks import BlockPool, Buffer, read_blocks
from ._token_position import MARK, VERSION, TokenPosition

__all__ = ["MARK", "VERSION", "TokenStream"]

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
#: Default bytes per read block. On S3, 2 MiB requests reached half the throughput of one
#: streaming read and 8 MiB about all of it.
_BLOCK_BYTES = 8 << 20
#: The same on a local disk. Read in the consumer's thread (``read_ahead=0``), the pool alternates
#: two buffers (the caller holds the last item of a block while the next is read). In probes of 2026-12-06,
#: a plain read alternating two 8 MiB buffers took 5-18% longer than with one, two 4 MiB ones
#: (8 MiB of destination, as the plain read's one buffer) 0-5%. Smaller blocks cost Python per
#: block (about 5 us each now; 2 MiB blocks measured slower than 8 MiB when that was 10-15 us).
#: docs/benchmarks.md, "Token stream".
_LOCAL_BLOCK_BYTES = 4 << 20
#: Blocks read ahead by helper threads on a remote store (S3, volumes, fsspec): with
#: :data:`_BLOCKS_PER_REQUEST`, 8 requests of 16 MiB in flight (an object store's connection
#: moves far less than a local disk, so a reader needs several at once; boto3's TransferManager
#: keeps 10 in flight).
_READ_AHEAD = 16
#: The same on a local disk: a helper thread's read (which releases the GIL) overlaps the
#: consumer's per-item Python. 4 measured 0.95-0.99x a plain read of the page cache or a cold
#: file, reading in the consumer's thread 0.90-0.92x in the same session (docs/benchmarks.md).
_LOCAL_READ_AHEAD = 4
#: Consecutive blocks of a shard fetched by one request on a remote store: each request costs
#: the client about 1-1.5 ms of CPU (botocore's signing and parsing; benchmarks/probe_s3_request_cost.py),
#: so fewer, larger requests leave more of the cores to the reads. 2 with 16 read ahead (16 MiB
#: requests, 8 in flight) measured 0.98-1.07x a plain streaming read on SeaweedFS, 1 with 8
#: (the earlier default, 8 requests of 8 MiB) 0.89-0.99x. 4 with 8 measured about the same as
#: 2 with 16 there, in less memory, but keeps only 1-2 requests in flight: on a store whose
#: connections are slower than its server (any real one), that would cut a reader's throughput
#: (docs/benchmarks.md, "Token stream").
_BLOCKS_PER_REQUEST = 2


class TokenStream(TokenPosition, IterableDataset):
    """Sequences of ``seq_len`` tokens from ``shards`` (names under ``root``), as ``torch.uint16``
    or ``torch.uint32`` tensors: one ``(seq_len,)`` tensor per sequence, or with ``batch_size``
    one ``(batch_size, seq_len)`` tensor per batch (use it with ``DataLoader(batch_size=None)``:
    the Python cost of one item is then paid per batch, not per sequence). Items are views of the
    block read, no copy (convert on the device, e.g. ``batch.to(device).long()``; a conversion
    here would cost more than the read), except batches that span blocks or shards (copied).

    The next ``read_ahead`` blocks are read by helper threads while one is consumed, across shard
    boundaries, so the reads overlap each other and the training loop's use of the data. Blocks
    are read into a pool of reused buffers; a buffer is refilled only once no yielded tensor views
    it any more, so tensors a caller keeps never change (a kept one costs a new buffer instead).

    Args:
        root: the location of the shards (a path, ``s3://bucket/prefix``, a volume path).
        shards: shard file names under ``root``, in a fixed order every rank agrees on.
        seq_len: tokens per sequence.
        dtype: ``"uint16"`` or ``"uint32"`` (little-endian).
        batch_size: yield ``(batch_size, seq_len)`` batches instead of sequences; the last batch
            of a reader's stretch may be shorter (nothing is dropped). The saved state counts
            sequences, so it resumes exactly under any batch size, world size or worker count.
        block: sequences per buffer (default: 8 MiB worth, 4 MiB on a local disk, rounded
            down to a multiple of ``batch_size``; measured on S3, 2 MiB requests reach half the
            throughput of one streaming read and 8 MiB about all of it; locally, see
            :data:`_LOCAL_BLOCK_BYTES`).
        read_ahead: blocks read ahead by helper threads, per reader. Default: 16 for remote
            stores (S3, volumes, fsspec), 4 on a local disk. An object store needs several
            requests in flight to match one streaming read; on a local disk the helper thread's
            copy overlaps the consumer's Python (4 measured 0.95-0.99x a plain read, 0 about
            0.90-0.92x; docs/benchmarks.md). 0: each block is read in the consumer's thread when
            it is reached, no threads. Memory is about ``read_ahead + 3`` blocks per reader
            (152 MiB at 16 on S3, 28 MiB at 4 locally): the blocks being read or
            waiting, the block consumed, blocks waiting for their last views to be dropped; plus
            any block whose views the caller keeps. Idle buffers (up to ``read_ahead + 2``) stay
            with the process for the next stream.
        blocks_per_request: consecutive blocks of a shard fetched by one request, streamed into
            their buffers in turn (a request is sent once all its blocks fit in ``read_ahead``).
            Default: 2 on remote stores (16 MiB GETs into 8 MiB buffers, 8 in flight: each
            request costs the client about 1-1.5 ms of CPU; on SeaweedFS this reached 0.98-1.07x a
            plain streaming read where 8 GETs of one block reached 0.89-0.99x), 1 on a local
            disk.
        storage_options: options of ``open_store``.
        num_replicas, rank: default to the default process group's (or 1 and 0 without one).
    """

    def __init__(
        self,
        root: str,
        shards: Sequence[str],
        *,
        seq_len: int,
        dtype: str = "uint16",
        batch_size: int | None = None,
        block: int | None = None,
        read_ahead: int | None = None,
        blocks_per_request: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be positive or None, got {batch_size}")
        if (block is not None and block < 1) or (read_ahead is not None and read_ahead < 0) or not shards:
            raise ValueError("block must be positive, read_ahead not negative and shards non-empty")
        if blocks_per_request is not None and blocks_per_request < 1:
            raise ValueError(f"blocks_per_request must be positive or None, got {blocks_per_request}")
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.root, self.shards, self.seq_len, self.dtype, self.block = str(root), list(shards), seq_len, dtype, block
        self.read_ahead, self.batch_size, self.blocks_per_request = read_ahead, batch_size, blocks_per_request
        self.storage_options = dict(storage_options or {})
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self._seq_bytes = seq_len * np.dtype(_DTYPES[dtype]).itemsize
        self._lengths: list[int] | None = None  # sequences per shard, read once (sizes)
        self._sizes: list[int] | None = None  # bytes per shard, recorded in the state
        self._base = [0] * len(self.shards)  # per-shard sequences consumed when this stretch began
        self._progress: dict[int, int] = {}  # this reader's own shards: sequences consumed
        self._slot = (self.rank, 0, self.num_replicas, 1)
        # The block being yielded from: (shard, its count before the block, sequences per item,
        # items, the iterator over them). Its count is taken from the iterator when the state is
        # asked for, instead of being stored before every yield (a dict store per sequence).
        self._live: tuple[int, int, int, int, Iterator[torch.Tensor]] | None = None

    def _block_for(self, kind: str) -> int:
        """``block``, or by default the sequences in :data:`_LOCAL_BLOCK_BYTES` on a local disk
        and :data:`_BLOCK_BYTES` elsewhere, rounded down to a multiple of ``batch_size`` (so
        batches stay views)."""
        if self.block is not None:
            return self.block
        block = max(1, (_LOCAL_BLOCK_BYTES if kind == "local" else _BLOCK_BYTES) // self._seq_bytes)
        if self.batch_size is not None:
            block = max(self.batch_size, block // self.batch_size * self.batch_size)
        return block

    def lengths(self, store: Any = None) -> list[int]:
        """Sequences in each shard (its size // sequence bytes); ``store``: this stream's, if
        already open."""
        if self._lengths is None:
            store = open_store(self.root, self.storage_options) if store is None else store
            sizes = [store.size(s) for s in self.shards]
            missing = [s for s, n in zip(self.shards, sizes) if n is None]
            if missing:
                raise CheckpointError(f"token shards missing under {store.uri}: {missing[:5]}", path=store.uri)
            self._sizes = list(sizes)
            self._lengths = [n // self._seq_bytes for n in sizes]
        return self._lengths

    def _mine(self, rank: int, worker: int, ranks: int, workers: int, lengths: list[int]) -> list[int]:
        """The unfinished shards of this stretch that (rank, worker) reads, in order."""
        todo = [i for i, n in enumerate(lengths) if self._base[i] < n]
        slot, slots = rank * workers + worker, ranks * workers
        return todo[slot::slots]

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        self._slot = (self.rank, worker, self.num_replicas, workers)
        store = open_store(self.root, self.storage_options)
        lengths = self.lengths(store)
        mine = self._mine(self.rank, worker, self.num_replicas, workers, lengths)
        block = self._block_for(store.traits.kind)
        # The start of each shard is read when its first block is queued (ahead of consumption):
        # a shard's count moves only while it is consumed, which is after all its blocks are queued.
        tasks = (
            (i, p, min(block, lengths[i] - p), p + block >= lengths[i])
            for i in mine
            for p in range(self._progress.get(i, self._base[i]), lengths[i], block)
        )
        local = store.traits.kind == "local"
        ahead = self.read_ahead
        if ahead is None:
            ahead = _LOCAL_READ_AHEAD if local else _READ_AHEAD
        per_request = self.blocks_per_request
        if per_request is None:
            per_request = 1 if local else _BLOCKS_PER_REQUEST
        pool = BlockPool(block, self.seq_len, _DTYPES[self.dtype], keep=ahead + 2)
        # Helper threads per iterator (never on self: the dataset is pickled into workers),
        # started as reads need them; none with read_ahead=0.
        threads = ThreadPoolExecutor(ahead, thread_name_prefix="token-read") if ahead else None
        blocks = read_blocks(
            threads, pool, tasks, lambda i: store.open_source(self.shards[i]), ahead, self._seq_bytes, per_request
        )
        try:
            if self.batch_size is None:
                yield from self._sequences(blocks)
            else:
                yield from self._batches(blocks, self.batch_size)
        finally:
            self._settle()
            blocks.close()
            if threads is not None:
                threads.shutdown()

    def _settle(self) -> None:
        """Fold the count of the block being yielded from into ``_progress``."""
        if self._live is not None:
            i, start, step, n, it = self._live
            self._live = None
            self._progress[i] = start + (n - it.__length_hint__()) * step

    def _sequences(self, blocks: Iterator[tuple[int, int, torch.Tensor, Buffer]]) -> Iterator[torch.Tensor]:
        """One ``(seq_len,)`` view per sequence; the count moves before each yield (the state
        taken after a yield counts that sequence)."""
        for i, pos, rows, _buf in blocks:
            # No Python per item: ``yield from`` a tuple iterator, whose remaining length tells
            # how many were yielded when the state is asked for (_settle, state_dict).
            views = rows.unbind(0)  # views; unbind is cheaper than indexing
            it = iter(views)
            self._live = (i, pos, 1, len(views), it)
            yield from it
            self._live = None
            self._progress[i] = pos + len(views)
            rows = views = None  # the pool may refill the block once the caller lets go too

    def _batches(self, blocks: Iterator[tuple[int, int, torch.Tensor, Buffer]], size: int) -> Iterator[torch.Tensor]:
        """``(size, seq_len)`` batches: a view where the batch lies in one block, a copy where it
        spans blocks or shards; the last one of this reader's stretch may be shorter (nothing
        is dropped). Every shard a batch takes from has its count moved before the yield."""
        progress = self._progress
        parts: list[torch.Tensor] = []
        marks: list[tuple[int, int]] = []  # (shard, its count once the part is consumed), per part

        def joined() -> torch.Tensor:
            batch = torch.cat(parts)  # a copy: no view of the pool's buffers survives in it
            for s, c in marks:
                progress[s] = c
            parts.clear()
            marks.clear()
            return batch

        have = 0
        for i, pos, rows, buf in blocks:
            n, a = rows.shape[0], 0
            if parts:  # complete the batch begun in an earlier block (or shard)
                a = min(size - have, n)
                parts.append(rows[:a])
                marks.append((i, pos + a))
                have += a
                if have == size:
                    have = 0
                    yield joined()
            if a < n:
                full = (n - a) // size
                if full:
                    # one unbind for all the batches (slicing one by one costs ~1 us each), of the
                    # buffer's kept 3-D view when the block is the whole buffer (most blocks)
                    if a == 0 and full * size == n and rows is buf.rows:
                        views = buf.grouped(size).unbind(0)
                    else:
                        views = rows.narrow(0, a, full * size).view(full, size, -1).unbind(0)
                    it = iter(views)  # as in _sequences: no Python per item
                    self._live = (i, pos + a, size, full, it)
                    yield from it
                    self._live = None
                    self._progress[i] = pos + a + full * size
                    views = None
                rest = n - a - full * size
                if rest:  # the block's tail: the start of the next batch
                    parts.append(rows.narrow(0, n - rest, rest))
                    marks.append((i, pos + n))
                    have = rest
            rows = buf = None  # the pool may refill the block once the caller lets go too
        if parts:
            yield joined()
