"""S3 store: ``s3://bucket/prefix`` on AWS S3 or any S3-compatible server, through boto3.

Why these choices:
- A data file is a multipart upload whose parts go up in parallel, one per writer chunk; a
  single short file is one ``PutObject``. Any failure aborts the upload (``_s3_upload``); reads
  are ranged GETs that resume a cut transfer (``_s3_download``).
- The commit record is one ``PutObject``, last: S3 makes a PUT visible whole or not at all, and
  reads after it are strongly consistent, so no rename or copy is needed. Without ``replace`` the
  PUT is conditional (``If-None-Match: *``, honoured by AWS S3, SeaweedFS and moto), so two
  savers cannot both commit. On servers that reject the condition the store falls back to
  check-then-put: a ``HeadObject`` then a plain PUT, with a race window between the two (two
  savers that both pass the check both write, and the later PUT wins). Servers that silently
  ignore the header cannot be told apart; there the only check is the save's own, before any
  rank writes (the listing of the location), and the window is the save's duration.
- Requests are retried here, not by botocore, with jittered exponential backoff within a time
  budget (``_s3_retry``); stalls are cut by the read timeout and retried.
- Clients, the upload semaphore and locks are created on first use and never pickled, because
  ``dcp.async_save`` pickles the writer that holds this store. How the client is built (a shared
  session, signing, checksums) is in ``_s3_client``.
- Every part and object carries its CRC-32 (``x-amz-checksum-crc32``, in a header we compute,
  never an aws-chunked trailer, which many S3-compatible servers reject); the server checks it on
  receipt, so bodies go unsigned instead of SHA-256 signed: half the CPU per byte, which bounds
  save throughput on small machines. blake3, checked on every read, covers the bytes end to end.

User guide: ``docs/s3.md``.

Credentials come from boto3's standard chain, the client or session given, or the
``aws_access_key_id`` / ``aws_secret_access_key`` / ``aws_session_token`` options. They appear in
no repr, message, log record or manifest; the config holds them (pickled with the writer for
``dcp.async_save``'s process executor) and hands them only to boto3.

A save killed mid-upload leaves its multipart uploads open (stored, billed, invisible). When a
save starts, the coordinator aborts those under this location that have been idle for
``S3Config.stale_upload_age`` (``_s3_stale``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ..errors import CheckpointError
from ._s3_bodies import crc32_b64
from ._s3_client import make_client
from ._s3_config import DEFAULT_PART_SIZE, MIN_PART_SIZE, S3Config
from ._s3_delete import delete_keys
from ._s3_download import S3Source
from ._s3_retry import call_with_retries, client_error_code, is_not_found
from ._s3_stale import abort_stale_uploads
from ._s3_upload import S3Sink
from .base import (
    SMALL_FILE_LIMIT,
    StoreTraits,
    check_relative_name,
    committed_elsewhere_error,
    read_capped,
    redact,
    too_large_error,
)

__all__ = ["MIN_PART_SIZE", "S3Config", "S3Store", "parse_s3_uri"]

T = TypeVar("T")
log = logging.getLogger("goodput_ckpt.storage.s3")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://bucket/prefix`` (the prefix without slashes at its ends).

    Credentials in the URI (``s3://KEY:SECRET@bucket``) are refused, and no message quotes them.

    Raises:
        ValueError: not an ``s3://`` URI, no bucket, credentials in it, or a prefix with empty,
            ``.`` or ``..`` parts.
    """
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {redact(uri)!r}")
    rest = uri[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket:
        raise ValueError(
            f"S3 URI {redact(uri)!r} contains credentials (user:secret@): pass them as options "
            "(aws_access_key_id, aws_secret_access_key) or through the standard AWS credential chain"
        )
    if not bucket or any(c in bucket for c in "?#:") or bucket.strip() != bucket:
        # Not quoted: a secret key may hold a "/", so "s3://KEY:SE/CRET@bucket" lands here.
        raise ValueError(
            "invalid S3 URI: expected s3://bucket/prefix, with a bucket name of letters, digits, "
            "'.' and '-' (credentials go in options or the AWS credential chain, never the URI)"
        )
    prefix = prefix.strip("/")
    if prefix:
        try:
            check_relative_name(prefix)
        except CheckpointError as e:
            raise ValueError(f"invalid S3 URI {redact(uri)!r}: {e}") from None
    return bucket, prefix


class S3Store:
    """A checkpoint location under ``s3://bucket/prefix``."""

    def __init__(self, uri: str, config: S3Config | None = None) -> None:
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.config = config or S3Config()
        # Parts go up in parallel, in any order; the DCP writer refuses chunks (parts) smaller
        # than S3's minimum; requests are billed, so ranks share one manifest read
        # (dcp/manifest_share.py).
        self.traits = StoreTraits(
            kind="s3", random_writes=True, min_part_size=self.config.part_size or MIN_PART_SIZE, costly_requests=True
        )
        self._policy = self.config.retry_policy
        self._init_runtime()

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r}, {self.config!r})"

    # -- lazily created, never pickled --------------------------------------------------------
    def _init_runtime(self) -> None:
        self._lock = threading.Lock()  # guards creating the client and the semaphore
        self._client: Any = None
        self._slots: threading.BoundedSemaphore | None = None

    def __getstate__(self) -> dict[str, Any]:
        if self.config.client is not None or self.config.session is not None:
            raise TypeError(
                f"the store for {self.uri} holds a user-supplied boto3 client or session, which "
                "cannot be pickled (dcp.async_save's process executor pickles the writer): use the "
                "thread executor, or let the store build its client from the default credentials"
            )
        state = self.__dict__.copy()
        for name in ("_lock", "_client", "_slots"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def client(self) -> Any:
        """The boto3 client (thread-safe), created on first use."""
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = make_client(self.config, self.uri)
                client = self._client
        return client

    def slots(self) -> threading.BoundedSemaphore:
        """The store-wide cap on multipart parts in flight."""
        slots = self._slots
        if slots is None:
            with self._lock:
                if self._slots is None:
                    self._slots = threading.BoundedSemaphore(self.config.max_concurrency)
                slots = self._slots
        return slots

    def call(
        self,
        what: str,
        key: str,
        fn: Callable[[], T],
        *,
        stop: threading.Event | None = None,
        translate: Callable[[BaseException], BaseException | None] | None = None,
    ) -> T:
        """Run one request with retries (see :func:`~._s3_retry.call_with_retries`)."""
        return call_with_retries(
            fn, policy=self._policy, what=what, where=self.where(key), stop=stop, translate=translate
        )

    # -- names -------------------------------------------------------------------------------
    def key(self, name: str) -> str:
        name = check_relative_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    # -- Store -------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Nothing to do (object stores have no directories; the bucket must exist). The
        clean-up of stale uploads runs once per save, on the coordinator
        (:meth:`abort_stale_uploads_before_save`), not on every rank."""

    def abort_stale_uploads_before_save(self, *, recursive: bool = False) -> None:
        """Before a save (the coordinator, before any rank writes): abort this location's stale
        multipart uploads, those idle for ``S3Config.stale_upload_age``; with ``recursive``,
        also those of nested locations (a manager root's steps, once per manager).

        DCP plans collectively before any rank writes, so no upload of this save exists yet.
        The clean-up is best effort: a failure (a policy without
        ``s3:ListBucketMultipartUploads``, say) is logged and the save goes on.
        """
        if self.config.stale_upload_age is None or not self.prefix:
            return
        try:
            self.abort_stale_uploads(older_than=self.config.stale_upload_age, recursive=recursive)
        except CheckpointError as e:
            log.warning("could not clean up stale multipart uploads under %s: %s", self.uri, e)

    def abort_stale_uploads(self, *, older_than: float, recursive: bool = False) -> list[str]:
        """Abort the multipart uploads under this location idle for ``older_than`` seconds.

        Idle: neither started nor given a part for that long, by the server's clock. Reclaims
        the parts of saves that were killed mid-upload (see ``S3Config.stale_upload_age``).

        Args:
            older_than: seconds of inactivity (0: every open upload, live ones included).
            recursive: also uploads under nested prefixes (a manager root's step locations);
                by default only files directly under this location, this checkpoint's own.

        Returns:
            The keys whose uploads were aborted.

        Raises:
            CheckpointError: listing or aborting failed after retries.
        """
        return abort_stale_uploads(self, older_than=older_than, recursive=recursive)

    def open_sink(self, name: str, *, part_size: int | None = None) -> S3Sink:
        unit = part_size or self.config.part_size or DEFAULT_PART_SIZE
        split = self.config.part_size or unit
        if unit < MIN_PART_SIZE or unit % split:
            raise ValueError(
                f"part size {unit} for {self.where(self.key(name))}: must be at least {MIN_PART_SIZE} "
                f"bytes (S3's minimum part) and a multiple of part_size={split}"
            )
        return S3Sink(self, self.key(name), unit, split)

    def open_source(self, name: str) -> S3Source:
        # No request here: a missing object is reported by the first read.
        return S3Source(self, self.key(name))

    def size(self, name: str) -> int | None:
        return self.size_of_key(self.key(name))

    def size_of_key(self, key: str) -> int | None:
        client = self.client()

        def head() -> int | None:
            try:
                return int(client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
            except Exception as e:
                if is_not_found(e):
                    return None
                raise

        return self.call("inspecting", key, head)

    def read_small(self, name: str, *, max_bytes: int = SMALL_FILE_LIMIT) -> bytes | None:
        key = self.key(name)
        client = self.client()

        def get() -> bytes | None:
            try:
                # The Range caps what the server sends, whatever the object holds; its size
                # comes back in ContentRange ("bytes 0-N/SIZE").
                resp = client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{max_bytes}")
            except Exception as e:
                if is_not_found(e):
                    return None
                code, status = client_error_code(e)
                if code == "InvalidRange" or status == 416:  # an empty object has no byte 0
                    return b""
                raise
            body = resp["Body"]
            size = _total_size(resp)
            if (size is not None and size > max_bytes) or int(resp.get("ContentLength") or 0) > max_bytes:
                body.close()
                raise too_large_error(self.where(key), size, max_bytes)
            try:  # the Range bounds it too; a server that ignored it is refused here
                data = read_capped(body.read, self.where(key), max_bytes, expected=int(resp.get("ContentLength") or 0))
            finally:
                body.close()
            return data

        return self.call("reading", key, get)

    def put_commit_record(self, name: str, data: bytes, *, replace: bool) -> None:
        """One PUT, after every data file was completed (S3 is read-after-write consistent).

        Without ``replace``: a conditional PUT, or check-then-put where the server refuses the
        condition (see the module docstring for the race that leaves).
        """
        key = self.key(name)
        client = self.client()
        # A bytearray: botocore would turn bytes into a file object (a 100-continue round trip).
        body = bytearray(data)
        crc = {"ChecksumCRC32": crc32_b64(body)} if self.config.checksums else {}
        if replace:
            self.call("committing", key, lambda: client.put_object(Bucket=self.bucket, Key=key, Body=body, **crc))
            return
        # No HeadObject first (issue 37: one request per save): the condition refuses an existing
        # record by itself, and the save checked the location before any rank wrote
        # (engine/hashed_write.py); a HEAD here only narrowed the race on servers that ignore it.
        exists = committed_elsewhere_error(self.where(key))
        attempts = [0]

        def put() -> None:
            attempts[0] += 1
            try:
                client.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*", **crc)
            except Exception as e:
                code, status = client_error_code(e)
                if code == "PreconditionFailed" or status == 412:
                    # After a lost response our own first attempt may be what now exists.
                    if attempts[0] > 1 and self.read_small(name) == body:
                        return
                    raise exists from e
                if code in ("NotImplemented", "InvalidArgument", "InvalidRequest") or status == 501:
                    # The server refuses conditional writes: check-then-put (racy, see above).
                    if self.size_of_key(key) is not None:
                        raise exists from e
                    client.put_object(Bucket=self.bucket, Key=key, Body=body, **crc)
                    return
                raise

        self.call("committing", key, put)

    def list(self) -> list[str]:
        return sorted(name for name, _ in self._listing())

    def list_sizes(self, *, max_entries: int | None = None) -> dict[str, int]:
        """Files' sizes from the listing: 1,000 a request instead of a ``HEAD`` each
        (:func:`~.bulk.file_sizes`); no more pages once ``max_entries`` objects were listed."""
        return dict(self._listing(max_entries))

    def _listing(self, max_entries: int | None = None) -> Iterator[tuple[str, int]]:
        """``(relative name, size)`` of the objects under the location, page by page (every
        page, or until ``max_entries`` objects were listed)."""
        client = self.client()
        base = f"{self.prefix}/" if self.prefix else ""
        token: str | None = None
        listed = 0
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": base}
            if token:
                kwargs["ContinuationToken"] = token
            page = self.call("listing", base, lambda: client.list_objects_v2(**kwargs))
            contents = page.get("Contents", ())
            for obj in contents:
                rel = obj["Key"][len(base) :]
                if rel and not rel.endswith("/"):
                    yield rel, int(obj.get("Size") or 0)
            listed += len(contents)
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token or (max_entries is not None and listed >= max_entries):
                return

    def delete(self, name: str) -> None:
        key = self.key(name)
        client = self.client()
        self.call("deleting", key, lambda: client.delete_object(Bucket=self.bucket, Key=key))

    def delete_many(self, names: Sequence[str]) -> None:
        """``DeleteObjects``, 1,000 keys a request, per-key failures retried or raised
        (``_s3_delete``)."""
        delete_keys(self, [self.key(n) for n in names])


def _total_size(resp: dict[str, Any]) -> int | None:
    """The object's size from a ranged GET's ``ContentRange`` (``bytes 0-9/1234``), if given."""
    total = str(resp.get("ContentRange") or "").rpartition("/")[2]
    return int(total) if total.isdigit() else None
