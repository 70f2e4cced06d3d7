"""Writing a data file to S3: a parallel multipart upload, or one ``PutObject`` when it is short.

The DCP writer hands a sink one chunk per ``write_at`` call, at an offset that is a multiple of its
chunk size (``part_size`` here), from several threads and in any order. Each call becomes one
multipart part (or several, when ``S3Config.part_size`` is smaller than the chunk), numbered
``offset // split + 1``, so parts need no coordination and may finish in any order.
``write_at`` copies the chunk into one contiguous body (botocore sends a ``bytearray`` with one
``sendall``; a file-like body would cost a ``100-continue`` round trip and a read per 128 KiB)
and hands it to the sink's upload pool, then returns: hashing the next chunks overlaps with the
uploads. The copy is made in cache-sized pieces, and each piece, once copied, is also
CRC-summed and (through ``write_hashed``, which the DCP writer uses) blake3-hashed while it is
still in the CPU cache: one pass over the tensor memory instead of three, and the digest and the
CRC cover exactly the bytes sent, even if the source changed meanwhile. A store-wide semaphore
caps the parts in flight, which bounds both the memory held in bodies (``max_concurrency x part
size``) and the connections in use.

A file that is a single chunk shorter than a part is one ``PutObject``: no multipart upload.
``close()`` waits for every part, checks that the parts tile ``[0, size)`` without a gap, then
completes the upload. Any failure (a part that exhausted its retries, a gap, a failed
completion) aborts the upload instead, so a file is never completed with missing parts.

The stored size is checked (one ``HeadObject``) after a ``PutObject`` or a completion only where
the server did not confirm the CRC-32 of every body it received (:func:`server_checked`): AWS S3
and SeaweedFS confirm it, and then the object holds exactly the bytes sent; moto does not, nor a
store with ``checksums=False``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ._s3_bodies import BODIES, b64, fill
from ._s3_retry import is_no_such_upload
from .base import byte_views

if TYPE_CHECKING:
    from .s3 import S3Store

__all__ = ["MAX_PARTS", "S3Sink", "ignore_no_such_upload", "server_checked"]

log = logging.getLogger("goodput_ckpt.storage.s3")

#: S3 numbers parts 1 to 10,000.
MAX_PARTS = 10_000
#: PUTs of one small file whose stored size differs from the body sent, before the save fails.
SHORT_OBJECT_ATTEMPTS = 3


class S3Sink:
    """One data file being written to ``key`` (see the module docstring)."""

    def __init__(self, store: S3Store, key: str, unit: int, split: int) -> None:
        self._store = store
        self._key = key
        self._where = store.where(key)
        self._unit = unit  # every write_at but the file's last covers exactly this many bytes
        self._split = split  # bytes per multipart part (divides unit)
        # Guards the upload id, the part table, the futures and the state.
        self._lock = threading.Lock()
        # Held while creating the multipart upload, so only one thread creates it.
        self._create_lock = threading.Lock()
        self._upload_id: str | None = None
        # part number -> (offset, length, ETag, CRC-32 or None)
        self._parts: dict[int, tuple[int, int, str, str | None]] = {}
        self._put_size: int | None = None  # set when the file went up as one PutObject
        self._unchecked_parts = 0  # parts whose CRC-32 the server did not confirm (server_checked)
        self._futures: list[Future] = []
        self._pool: ThreadPoolExecutor | None = None
        self._failed = threading.Event()  # first failure: queued parts skip, retries stop
        self._error: BaseException | None = None
        self._state = "open"  # -> "closed" | "aborted"

    # -- FileSink --------------------------------------------------------------------------
    def write_at(self, offset: int, buffers: Sequence[Any]) -> None:
        self.write_hashed(offset, buffers, None)

    def write_hashed(self, offset: int, buffers: Sequence[Any], hasher: Any) -> None:
        """``write_at`` that also hands the chunk's bytes, in order, to ``hasher.update`` (when
        not ``None``) as they are copied into the part bodies: the writer's blake3 then reads
        the copy while it is in the CPU cache instead of making a pass of its own over the
        source, and covers exactly the bytes sent (``hashed_write`` uses it when a sink has it).
        """
        self._check_usable()
        views = byte_views(buffers)
        n = sum(v.nbytes for v in views)
        if offset % self._unit:
            raise CheckpointError(
                f"write at offset {offset} of {self._where}: not a multiple of the part size {self._unit} (a writer bug)",
                path=self._where,
            )
        checksums = self._store.config.checksums
        if offset == 0 and n < self._unit:
            # The whole file is this one short chunk (every other chunk is a full unit).
            body = bytearray(n)
            crc = fill(views, 0, n, body, hasher, checksums)
            self._put(body, crc)
            with self._lock:
                self._put_size = n
            return
        if n > self._unit:
            raise CheckpointError(
                f"write of {n} bytes to {self._where} exceeds the part size {self._unit} (a writer bug)",
                path=self._where,
            )
        upload_id = self._ensure_upload()
        for start in range(0, n, self._split):
            end = min(n, start + self._split)
            number = (offset + start) // self._split + 1
            if number > MAX_PARTS:
                raise CheckpointError(
                    f"{self._where} needs more than {MAX_PARTS} multipart parts of {self._split} bytes: "
                    "use a larger chunk_size, or more files per rank (files_per_rank)",
                    path=self._where,
                )
            slots = self._store.slots()
            self._acquire_slot(slots)
            try:
                self._check_usable()
                body = BODIES.take(end - start)
                crc = fill(views, start, end, body, hasher, checksums)
                fut = self._executor().submit(self._upload_part, upload_id, number, offset + start, body, crc)
            except BaseException:
                slots.release()
                raise
            # Released when the part is done, failed or cancelled: exactly once in every case.
            fut.add_done_callback(lambda _f: slots.release())
            with self._lock:
                self._futures.append(fut)

    def close(self) -> None:
        with self._lock:
            if self._state == "closed":
                return
            if self._state == "aborted":
                raise CheckpointError(f"{self._where} was aborted and cannot be completed", path=self._where)
        try:
            self._wait_parts()
            if self._error is not None:
                raise self._error
            if self._upload_id is None:
                if self._put_size is None:  # no bytes at all: an empty object
                    self._put(bytearray(), 0)
            else:
                self._complete()
            with self._lock:
                self._state = "closed"
        finally:
            self._shutdown_pool()

    def abort(self) -> None:
        """Stop the parts still queued, abort the multipart upload, delete a completed object.

        Best effort and never raises: the error that caused the abort is the one to report.
        """
        with self._lock:
            if self._state == "aborted":
                return
            was_closed = self._state == "closed"
            self._state = "aborted"
        self._failed.set()
        try:
            self._wait_parts()  # bounded: retries stop once _failed is set
        finally:
            self._shutdown_pool()
        client, bucket = self._store.client(), self._store.bucket
        try:
            if self._upload_id is not None and not was_closed:
                upload_id = self._upload_id
                self._store.call(
                    "aborting the multipart upload of",
                    self._key,
                    lambda: ignore_no_such_upload(
                        lambda: client.abort_multipart_upload(Bucket=bucket, Key=self._key, UploadId=upload_id)
                    ),
                )
            if was_closed or self._put_size is not None:
                self._store.call("deleting", self._key, lambda: client.delete_object(Bucket=bucket, Key=self._key))
        except CheckpointError as e:
            log.warning("could not clean up %s after a failed save: %s", self._where, e)

    # -- helpers ---------------------------------------------------------------------------
    def _put(self, body: bytearray, crc: int) -> None:
        # A bytearray, not bytes: botocore turns a bytes body of PutObject into a file object,
        # which costs a 100-continue round trip.
        client, bucket = self._store.client(), self._store.bucket
        extra = {"ChecksumCRC32": b64(crc)} if self._store.config.checksums else {}
        for attempt in range(1, SHORT_OBJECT_ATTEMPTS + 1):
            resp = self._store.call(
                "writing",
                self._key,
                lambda: client.put_object(Bucket=bucket, Key=self._key, Body=body, **extra),
                stop=self._failed,
            )
            if server_checked(resp, extra):
                return  # the server stored exactly the bytes whose CRC it checked: no HeadObject
            stored = self._store.size_of_key(self._key)
            if stored is None:
                self._vanished()
                return
            if stored == len(body):
                return
            if attempt < SHORT_OBJECT_ATTEMPTS:
                log.warning(
                    "%s was stored with %s bytes instead of %d; sending it again", self._where, stored, len(body)
                )
        raise self._short_object(stored, len(body))

    def _vanished(self) -> None:
        """An object gone right after it was stored was deleted by someone else: a writer that
        committed this location first removes the files its manifest does not name. Not a short
        body; the commit that follows refuses the location (``CheckpointExistsError``)."""
        log.info("%s was deleted right after it was stored (another writer committed here?)", self._where)

    def _short_object(self, stored: int | None, expected: int) -> CheckpointError:
        """The server kept other bytes than were sent: a body cut short in transit on a server that
        checks no checksum. Never committed: the caller aborts, which deletes the object."""
        return CheckpointError(
            f"{self._where} was stored with {stored} bytes instead of the {expected} sent (the request body "
            "was cut short on the way and the server did not check its checksum); the save is aborted",
            path=self._where,
            byte_range=(min(stored or 0, expected), expected),
        )

    def _check_usable(self) -> None:
        if self._state != "open":
            raise CheckpointError(f"{self._where} is already {self._state}", path=self._where)
        if self._error is not None:
            raise CheckpointError(
                f"an earlier part of {self._where} failed: {self._error}", path=self._where
            ) from self._error

    def _acquire_slot(self, slots: threading.BoundedSemaphore) -> None:
        # Waits in short steps so that a failure elsewhere in the file stops the wait.
        while not slots.acquire(timeout=0.5):
            self._check_usable()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                # One pool per file; the store-wide semaphore, not the pool size, bounds the
                # parts in flight across files.
                self._pool = ThreadPoolExecutor(self._store.config.max_concurrency, thread_name_prefix="goodput-s3-put")
            return self._pool

    def _shutdown_pool(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _ensure_upload(self) -> str:
        with self._create_lock:
            if self._upload_id is None:
                client, bucket = self._store.client(), self._store.bucket
                # With checksums, S3 requires the upload to name the parts' algorithm.
                extra = {"ChecksumAlgorithm": "CRC32"} if self._store.config.checksums else {}
                resp = self._store.call(
                    "starting the multipart upload of",
                    self._key,
                    lambda: client.create_multipart_upload(Bucket=bucket, Key=self._key, **extra),
                )
                self._upload_id = resp["UploadId"]
            return self._upload_id

    def _upload_part(self, upload_id: str, number: int, offset: int, body: bytearray, crc: int) -> None:
        try:
            if self._failed.is_set():
                raise CheckpointError(f"part {number} of {self._where} skipped: another part failed", path=self._where)
            client, bucket = self._store.client(), self._store.bucket
            # The server checks the CRC on receipt (a corrupted body fails with BadDigest and is
            # retried with the same body).
            extra = {"ChecksumCRC32": b64(crc)} if self._store.config.checksums else {}
            resp = self._store.call(
                f"uploading part {number} of",
                self._key,
                lambda: client.upload_part(
                    Bucket=bucket, Key=self._key, UploadId=upload_id, PartNumber=number, Body=body, **extra
                ),
                stop=self._failed,
            )
            with self._lock:
                self._parts[number] = (offset, len(body), resp["ETag"], extra.get("ChecksumCRC32"))
                if not server_checked(resp, extra):
                    self._unchecked_parts += 1
            if len(body) == self._split:  # (a file's short last part is a one-off size)
                BODIES.give(body, self._store.config.max_concurrency)
        except BaseException as e:
            with self._lock:
                if self._error is None:
                    self._error = e
            self._failed.set()
            raise

    def _wait_parts(self) -> None:
        """Wait for every submitted part; returns early once one failed (the rest are stopped)."""
        with self._lock:
            pending = list(self._futures)
        while pending:
            done, not_done = wait(pending, return_when=FIRST_EXCEPTION)
            pending = list(not_done)
            if any(f.exception() is not None for f in done if not f.cancelled()):
                self._failed.set()
                wait(pending)  # the others stop at their next attempt
                return

    def _complete(self) -> None:
        parts = sorted(self._parts.items())
        pos = 0
        for number, (offset, length, _etag, _crc) in parts:
            if offset != pos:
                raise CheckpointError(
                    f"{self._where}: bytes [{pos}, {offset}) were never written (part {number} starts at "
                    f"{offset}); refusing to complete an upload with missing parts",
                    path=self._where,
                    byte_range=(pos, offset),
                )
            pos = offset + length
        size = pos
        listing = {
            "Parts": [
                {"PartNumber": n, "ETag": etag, **({"ChecksumCRC32": crc} if crc else {})}
                for n, (_o, _l, etag, crc) in parts
            ]
        }
        client, bucket, upload_id = self._store.client(), self._store.bucket, self._upload_id

        def complete() -> None:
            try:
                client.complete_multipart_upload(
                    Bucket=bucket, Key=self._key, UploadId=upload_id, MultipartUpload=listing
                )
            except Exception as e:
                # A retried completion whose first attempt succeeded (its response was lost)
                # finds no upload: the object must then exist with exactly our size.
                if not is_no_such_upload(e):
                    raise
                if self._store.size_of_key(self._key) != size:
                    raise

        self._store.call("completing the multipart upload of", self._key, complete)
        with self._lock:
            if not self._unchecked_parts:
                return  # every part's bytes were checked on receipt, and the parts tile [0, size)
        stored = self._store.size_of_key(self._key)
        if stored is None:
            self._vanished()
        elif stored != size:
            # Completed short: delete it here, since an abort after a completion deletes only
            # single-PUT objects.
            self._store.call("deleting", self._key, lambda: client.delete_object(Bucket=bucket, Key=self._key))
            raise self._short_object(stored, size)


def server_checked(resp: Any, sent: dict[str, str]) -> bool:
    """Whether the server's answer to a ``PutObject`` or ``UploadPart`` confirms the CRC-32 we sent
    (``sent``: the request's checksum arguments, empty without ``checksums``).

    Why this replaces the ``HeadObject`` after each upload (issue 37, one request per file): a
    server that checks the checksum header refuses a body cut short or damaged on the way
    (``BadDigest``) and echoes the checksum it verified (AWS S3, SeaweedFS), so a success that
    carries our CRC means the object holds exactly the bytes sent. A server that neither checks
    nor echoes it (moto) gets the size check as before, and so does a store with
    ``checksums=False``.
    """
    crc = sent.get("ChecksumCRC32")
    return crc is not None and isinstance(resp, dict) and resp.get("ChecksumCRC32") == crc


def ignore_no_such_upload(fn) -> None:
    """Run ``fn`` (an abort); an upload that is already gone (aborted, completed) is no error."""
    try:
        fn()
    except Exception as e:
        if not is_no_such_upload(e):
            raise
