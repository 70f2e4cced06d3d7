"""Reading a data file from S3: ranged ``GetObject`` requests streamed into the destination.

``read_into`` is one ranged ``GetObject`` whose body is streamed straight into the destination
buffers; a transfer cut short by a reset or a stall resumes from the first byte not yet
received, within the same retry budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, IncompleteCheckpointError
from ._s3_retry import client_error_code, is_not_found
from .base import byte_views, missing_file_error, truncated_error

if TYPE_CHECKING:
    from .s3 import S3Store

__all__ = ["S3Source"]

#: Bytes per read from a response body. urllib3 reads into a temporary of the requested size
#: and copies it out, so one read per 16 MiB task would hold 32 MiB of transient buffers per
#: reader thread; 1 MiB pieces keep that small and reuse the allocator's memory.
READ_PIECE = 1 << 20


class S3Source:
    """Ranged reads of one object; safe to share between threads (botocore clients are)."""

    def __init__(self, store: S3Store, key: str) -> None:
        self._store = store
        self._key = key
        self._where = store.where(key)

    def read_into(self, offset: int, buffers: Sequence[Any]) -> None:
        views = byte_views(buffers)
        total = sum(v.nbytes for v in views)
        if total == 0:
            return
        end = offset + total
        got = [0]  # bytes received so far: a retry resumes after them
        client, bucket = self._store.client(), self._store.bucket

        def attempt() -> None:
            start = offset + got[0]
            resp = client.get_object(Bucket=bucket, Key=self._key, Range=f"bytes={start}-{end - 1}")
            body = resp["Body"]
            sent = resp.get("ContentLength")
            try:
                if "ContentRange" not in resp and start > 0:
                    raise CheckpointError(
                        f"reading {self._where}: the server ignored the Range header (bytes {start}-{end - 1})",
                        path=self._where,
                    )
                i, skip = _locate(views, got[0])
                while i < len(views):
                    n = body.readinto(views[i][skip : skip + READ_PIECE])
                    if not n:
                        break
                    got[0] += n
                    skip += n
                    if skip == views[i].nbytes:
                        i, skip = i + 1, 0
            finally:
                if got[0] < total:
                    body.close()  # drop a half-read connection rather than return it to the pool
            if got[0] < total:
                if sent is not None and start + sent < end:
                    raise self._short_error(offset, end, start + sent)  # the object is shorter
                from botocore.exceptions import IncompleteReadError

                # The body stopped early without an error: transient, resume from here.
                raise IncompleteReadError(actual_bytes=offset + got[0] - start, expected_bytes=end - start)

        def translate(e: BaseException) -> BaseException | None:
            if is_not_found(e):
                return missing_file_error(self._where)
            code, status = client_error_code(e)
            if code == "InvalidRange" or status == 416:
                return self._short_error(offset, end, None)
            return None

        self._store.call(f"reading bytes [{offset}, {end}) of", self._key, attempt, translate=translate)

    def _short_error(self, start: int, end: int, at: int | None) -> IncompleteCheckpointError:
        return truncated_error(self._where, start, end, at)

    def close(self) -> None:
        """Nothing to release: connections belong to the store's client pool."""


def _locate(views: list[memoryview], done: int) -> tuple[int, int]:
    """Index of the buffer holding byte ``done`` of the concatenation, and the offset in it."""
    for i, v in enumerate(views):
        if done < v.nbytes:
            return i, done
        done -= v.nbytes
    return len(views), 0
