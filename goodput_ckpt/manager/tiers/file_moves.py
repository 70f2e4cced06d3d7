"""Moving one data file between tiers, every byte checked against the manifest on the way.

A file moves whole, in its hash chunks, in order: from a store to a store (a persistent upload
from the local copy, a repair from the persistent tier) or from one rank to another over the
job's process group (a replica, a repair from a replica). The receiving side checks each
chunk's blake3 against the manifest before it writes it, so a damaged copy never spreads: the
move fails, naming the file, the byte range and the tier, and the partial file is removed.

Peer moves pair one sender with one receiver. Every rank goes through the same list of moves
in the same order (:func:`run_moves`), so the first unfinished move always has both its ends
at it, and a list never deadlocks. A sender that cannot read its copy still sends the file's
length (zeros where it failed): the receiver's check fails, and the two stay in step.

A receiver can also keep what it receives in memory instead of writing it to its store
(:class:`ReceivedFiles`), and a move can carry only some of a file's chunks: a two-tier
restore receives just the chunks a rank reads and loads them from memory, where its reader
checks them, without writing them and reading them back.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import blake3
import torch
import torch.distributed as dist

from ...errors import CheckpointError, IncompleteCheckpointError
from ...format.commit_record import KeyIndex, checksum_error
from ...format.schema import FileEntry
from ...storage.base import Buffer, Store, byte_views

__all__ = ["Move", "ReceivedFiles", "check_file", "copy_file", "run_moves"]

logger = logging.getLogger("goodput_ckpt.tiers")


def _pieces(entry: FileEntry, chunk_size: int, only: Collection[int] | None = None) -> Iterator[tuple[int, int, int]]:
    """(chunk index, offset, length) of each hash chunk of ``entry`` (of those in ``only``)."""
    for index, offset in enumerate(range(0, entry.size, chunk_size)):
        if only is None or index in only:
            yield index, offset, min(chunk_size, entry.size - offset)


def _check(entry: FileEntry, index: int, offset: int, view: memoryview, where: str, keys: KeyIndex | None) -> None:
    if index >= len(entry.chunks) or blake3.blake3(view).hexdigest() != entry.chunks[index]:
        end = offset + view.nbytes
        raise checksum_error(where, entry.path, offset, end, index, keys.keys(entry.path, offset, end) if keys else [])


def _buffer(chunk_size: int, size: int) -> torch.Tensor:
    return torch.empty(max(1, min(chunk_size, size)), dtype=torch.uint8)


def copy_file(src: Store, dst: Store, entry: FileEntry, chunk_size: int, *, keys: KeyIndex | None = None) -> None:
    """Copy the data file ``entry`` from the checkpoint location ``src`` to ``dst``, each chunk
    checked against the manifest before it is written (``keys``: the manifest's key index, so
    that a mismatch names the tensors it hits).

    Raises:
        CorruptCheckpointError: a chunk of the source does not match the manifest (nothing of
            the file is left at ``dst``).
        CheckpointError: a read or write failed.
    """
    buf = _buffer(chunk_size, entry.size)
    source = src.open_source(entry.path)
    try:
        sink = dst.open_sink(entry.path, part_size=chunk_size)
        try:
            for index, offset, length in _pieces(entry, chunk_size):
                view = memoryview(buf.numpy())[:length]
                source.read_into(offset, [view])
                _check(entry, index, offset, view, src.uri, keys)
                sink.write_at(offset, [view])
            sink.close()
        except BaseException:
            sink.abort()
            raise
    finally:
        source.close()


def check_file(
    store: Store,
    entry: FileEntry,
    chunk_size: int,
    *,
    threads: int = 4,
    only: Collection[int] | None = None,
    keys: KeyIndex | None = None,
) -> None:
    """Read the data file ``entry`` of the checkpoint location ``store`` and check its chunks
    against the manifest (every chunk, or the chunk indices in ``only``), ``threads`` chunks at a
    time (blake3 and the reads release the GIL), each thread with one reused buffer. ``keys``:
    the manifest's key index, so that a mismatch names the tensors it hits.

    Raises:
        CorruptCheckpointError: a chunk that does not match (file and byte range).
        CheckpointError: the file cannot be read.
    """
    pieces = [p for p in _pieces(entry, chunk_size) if only is None or p[0] in only]
    buffers: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
    for _ in range(max(1, min(threads, len(pieces)))):
        buffers.put(_buffer(chunk_size, entry.size))
    source = store.open_source(entry.path)

    def one(piece: tuple[int, int, int]) -> None:
        index, offset, length = piece
        buf = buffers.get()
        try:
            view = memoryview(buf.numpy())[:length]
            source.read_into(offset, [view])
            _check(entry, index, offset, view, store.uri, keys)
        finally:
            buffers.put(buf)

    try:
        if len(pieces) <= 1 or threads <= 1:
            for piece in pieces:
                one(piece)
        else:
            with ThreadPoolExecutor(min(threads, len(pieces)), thread_name_prefix="goodput-ckpt-check") as pool:
                for fut in [pool.submit(one, p) for p in pieces]:
                    fut.result()
    finally:
        source.close()


@dataclass(frozen=True)
class Move:
    """The data file ``entry`` from rank ``src``'s copy to rank ``dst``'s (same name, ``entry.path``);
    with ``chunks``, only those hash chunks (into memory only: a store gets whole files)."""

    src: int
    dst: int
    entry: FileEntry
    chunks: frozenset[int] | None = None

    @property
    def name(self) -> str:
        return self.entry.path


def _send(store: Store, move: Move, chunk_size: int, pg: dist.ProcessGroup) -> None:
    buf = _buffer(chunk_size, move.entry.size)
    source = None
    try:
        source = store.open_source(move.name)
    except CheckpointError as e:
        logger.warning("cannot read %s to send it to rank %d: %s", move.name, move.dst, e)
    try:
        for _, offset, length in _pieces(move.entry, chunk_size, move.chunks):
            piece = buf[:length]
            if source is not None:
                try:
                    source.read_into(offset, [memoryview(piece.numpy())])
                except CheckpointError as e:
                    logger.warning("cannot read %s to send it to rank %d: %s", move.name, move.dst, e)
                    source.close()
                    source = None
            if source is None:
                piece.zero_()  # the receiver's check fails; both ends stay in step
            dist.send(piece, group_dst=move.dst, group=pg)
    finally:
        if source is not None:
            source.close()


class _MemorySource:
    """A received file's chunks, read as a :class:`~goodput_ckpt.storage.base.FileSource`."""

    def __init__(self, chunks: dict[int, torch.Tensor], chunk_size: int, where: str) -> None:
        self._chunks = {i: t.numpy() for i, t in chunks.items()}
        self._chunk_size = chunk_size
        self._where = where

    def read_into(self, offset: int, buffers: Sequence[Buffer]) -> None:
        cs = self._chunk_size
        for view in byte_views(buffers):
            done = 0
            while done < view.nbytes:
                index, start = divmod(offset + done, cs)
                chunk = self._chunks.get(index)
                if chunk is None or start >= chunk.size:
                    raise IncompleteCheckpointError(
                        f"{self._where}: bytes from {offset + done} were not received", path=self._where
                    )
                n = min(view.nbytes - done, chunk.size - start)
                view[done : done + n] = chunk[start : start + n]
                done += n
            offset += view.nbytes

    def close(self) -> None:
        pass


class ReceivedFiles:
    """Files (or some of their chunks) received over the group, held in memory until the load
    that needs them has read them (a :class:`~goodput_ckpt.storage.base.FileOrigin`).

    Not checked on arrival: the reader checks every chunk it reads from here against the
    manifest (so a file never counts among its ``checked_files``); a chunk not received is
    not there to read (the read fails as a short file's would).
    """

    def __init__(self, uri: str, chunk_size: int) -> None:
        self.uri = uri
        self.chunk_size = chunk_size
        self.files: dict[str, dict[int, torch.Tensor]] = {}

    def open_source(self, name: str) -> _MemorySource:
        chunks = self.files.get(name)
        if chunks is None:
            raise IncompleteCheckpointError(f"{self.uri}/{name} was not received", path=f"{self.uri}/{name}")
        return _MemorySource(chunks, self.chunk_size, f"{self.uri}/{name}")


def _receive(
    store: Store | ReceivedFiles, move: Move, chunk_size: int, pg: dist.ProcessGroup, where: str, keys: KeyIndex | None
) -> CheckpointError | None:
    """Receive ``move`` into ``store``, written there and checked chunk by chunk on the way (the
    first bad chunk aborts the file but the rest is still received: the sender goes on
    sending), or kept in memory, unchecked, for a :class:`ReceivedFiles` (one buffer per chunk:
    memory for what was sent, whatever size the manifest gives the file). Returns the failure,
    or ``None``."""
    if isinstance(store, ReceivedFiles):
        chunks: dict[int, torch.Tensor] = {}
        for index, _, length in _pieces(move.entry, chunk_size, move.chunks):
            chunks[index] = torch.empty(length, dtype=torch.uint8)
            dist.recv(chunks[index], group_src=move.src, group=pg)
        store.files[move.name] = chunks
        return None
    assert move.chunks is None, "a store receives whole files"
    buf = _buffer(chunk_size, move.entry.size)
    failure: CheckpointError | None = None
    sink = None
    try:
        sink = store.open_sink(move.name, part_size=chunk_size)
    except CheckpointError as e:
        failure = e
    for index, offset, length in _pieces(move.entry, chunk_size):
        piece = buf[:length]
        dist.recv(piece, group_src=move.src, group=pg)
        if failure is not None:
            continue
        view = memoryview(piece.numpy())
        assert sink is not None
        try:
            _check(move.entry, index, offset, view, where, keys)
            sink.write_at(offset, [view])
        except CheckpointError as e:
            failure = e
            sink.abort()
    if failure is None and sink is not None:
        try:
            sink.close()
        except CheckpointError as e:
            failure = e
    return failure


def run_moves(
    moves: Sequence[Move],
    *,
    rank: int,
    store: Store,
    chunk_size: int,
    pg: dist.ProcessGroup,
    sender_uri: str,
    keys: KeyIndex | None = None,
    into: ReceivedFiles | None = None,
) -> dict[str, CheckpointError]:
    """Do this rank's part of ``moves`` (the same list, in the same order, on every rank): send
    the files it is the source of from ``store``, receive those it is the destination of into
    ``store``, or into memory, ``into``. ``sender_uri`` names the sending tier in errors ({rank} is the sender's rank), and
    ``keys`` (the manifest's key index) the tensors a bad chunk hits.

    Returns:
        The files this rank failed to receive, with why (a checksum mismatch names the file,
        the byte range and the sending rank).
    """
    failed: dict[str, CheckpointError] = {}
    for move in moves:
        if move.src == rank:
            _send(store, move, chunk_size, pg)
        elif move.dst == rank:
            err = _receive(
                store if into is None else into, move, chunk_size, pg, sender_uri.format(rank=move.src), keys
            )
            if err is not None:
                failed[move.name] = err
    return failed
