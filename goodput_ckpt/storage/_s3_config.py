"""The options of the S3 store (:class:`S3Config`), checked once when a store is opened.

Credential options are hidden from the repr and never quoted in messages: errors name the
option, never its value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from ._s3_retry import RetryPolicy

__all__ = ["CREDENTIALS", "DEFAULT_PART_SIZE", "MAX_PART_SIZE", "MIN_PART_SIZE", "S3Config"]

#: S3's smallest multipart part (all but the last part of an upload).
MIN_PART_SIZE = 5 << 20
#: S3's largest part, and the largest single PUT.
MAX_PART_SIZE = 5 << 30
#: Part size when a caller opens a sink without giving one (the DCP writer always gives its chunk).
DEFAULT_PART_SIZE = 8 << 20
_ADDRESSING = ("auto", "path", "virtual")
#: The credential options, in boto3's spelling. Never echoed: messages name them only.
CREDENTIALS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")


@dataclass(frozen=True, kw_only=True)
class S3Config:
    """Options of the S3 backend (``CheckpointWriter("s3://...", **options)``).

    Attributes:
        endpoint_url: the S3 endpoint (``http(s)://host:port``) of a non-AWS server. ``None``:
            boto3's choice (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, the config file, or
            AWS). Must not contain credentials.
        region: the signing region; ``None``: boto3's chain (``AWS_REGION``, config file).
        addressing_style: ``"path"`` (``host/bucket/key``, what most self-hosted servers need),
            ``"virtual"`` (``bucket.host/key``) or ``"auto"`` (botocore decides).
        max_concurrency: multipart parts in flight per store, across its files. Also bounds the
            memory held in part bodies (``max_concurrency x part size``).
        part_size: bytes per multipart part. ``None``: one part per writer chunk
            (``CheckpointWriter(chunk_size=...)``, 8 MiB by default). When set, the writer's
            chunk size must be a multiple of it. 5 MiB to 5 GiB.
        max_attempts: attempts per request, the first included, for transient failures
            (HTTP 5xx and 429, ``SlowDown``, connection errors, timeouts).
        retry_time_limit: seconds after a request's first attempt past which no retry starts;
            with the timeouts below it bounds how long a failing save takes to fail.
        connect_timeout: seconds to establish a connection.
        read_timeout: seconds without a byte from the server before an attempt is abandoned (a
            stalled response) and retried.
        checksums: send the CRC-32 of every part and object (``x-amz-checksum-crc32``), which
            the server checks on receipt, and send bodies without a SHA-256 signature (half the
            CPU). ``False``, for servers that reject checksum headers: no CRC, and over plain
            http bodies are SHA-256 signed instead (botocore's default).
        client: a ready boto3 S3 client to use instead of creating one. Its own endpoint,
            region, credentials, pool size and retries apply (turn botocore's retries off to avoid
            retrying twice). A store holding it cannot be pickled, so use ``dcp.async_save``'s
            thread executor (the default) with it.
        session: a boto3 ``Session`` to create the client from (its credentials and profile);
            the other options above still apply. Not picklable either.
        aws_access_key_id, aws_secret_access_key, aws_session_token: explicit credentials
            instead of boto3's chain (the key pair together; the token only with it). Hidden
            from reprs and never quoted in messages.
        stale_upload_age: seconds. When a save starts here (the coordinator, once:
            :meth:`S3Store.abort_stale_uploads_before_save`), multipart
            uploads of files directly under this location that have been idle this long (no
            part uploaded, nor the upload started, for this long, by the server's clock) are
            aborted: leftovers of a save that was killed. Every save of this store's own starts
            its uploads after this clean-up, so only another writer saving to the same location
            at the same time (which one of them loses anyway) could own an upload that is
            aborted, and only one stalled for longer than this. ``None``: never. Not at a
            bucket's root, whose uploads may belong to anything. A ``CheckpointManager`` on S3
            does this once for its whole root, at its first save, instead of at every step's
            save (``manager/saving.py``: one ``ListMultipartUploads`` per manager, not per save).

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range, or options that
            contradict each other (``client`` with ``session`` or with client settings).
    """

    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str = "auto"
    max_concurrency: int = 16
    part_size: int | None = None
    max_attempts: int = 10
    retry_time_limit: float = 120.0
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    checksums: bool = True
    client: Any = field(default=None, repr=False, compare=False)
    session: Any = field(default=None, repr=False, compare=False)
    aws_access_key_id: str | None = field(default=None, repr=False)
    aws_secret_access_key: str | None = field(default=None, repr=False)
    aws_session_token: str | None = field(default=None, repr=False)
    stale_upload_age: float | None = 600.0

    def __post_init__(self) -> None:
        if self.endpoint_url is not None:
            _check_endpoint(self.endpoint_url)
        if self.region is not None and (not isinstance(self.region, str) or not self.region):
            raise TypeError(f"region must be a non-empty string, got {self.region!r}")
        if self.addressing_style not in _ADDRESSING:
            raise ValueError(f"addressing_style must be one of {', '.join(_ADDRESSING)}, got {self.addressing_style!r}")
        _int_in("max_concurrency", self.max_concurrency, 1, 1024)
        if self.part_size is not None:
            _int_in("part_size", self.part_size, MIN_PART_SIZE, MAX_PART_SIZE)
        _int_in("max_attempts", self.max_attempts, 1, 100)
        if not isinstance(self.checksums, bool):
            raise TypeError(f"checksums must be a bool, got {type(self.checksums).__name__}")
        for name in ("retry_time_limit", "connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
                raise ValueError(f"{name} must be a number of seconds in (0, 86400], got {value!r}")
        age = self.stale_upload_age
        if age is not None and (
            isinstance(age, bool) or not isinstance(age, (int, float)) or not 0 <= age <= 365 * 86400
        ):
            raise ValueError(f"stale_upload_age must be None or a number of seconds in [0, 1 year], got {age!r}")
        _check_credentials(self)
        if self.client is not None:
            if self.session is not None:
                raise ValueError("pass either client or session, not both")
            own = [n for n in ("endpoint_url", "region", *CREDENTIALS) if getattr(self, n) is not None]
            if self.addressing_style != "auto":
                own.append("addressing_style")
            if own:
                raise ValueError(f"{', '.join(own)} cannot be combined with client: configure the client itself")
            meta = getattr(self.client, "meta", None)
            if getattr(getattr(meta, "service_model", None), "service_name", None) != "s3":
                raise TypeError(f"client must be a boto3 S3 client, got {type(self.client).__name__}")
        if self.session is not None and not callable(getattr(self.session, "client", None)):
            raise TypeError(f"session must be a boto3 Session, got {type(self.session).__name__}")

    @property
    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(max_attempts=self.max_attempts, time_limit=float(self.retry_time_limit))

    def credentials(self) -> dict[str, str]:
        """The explicit credentials given, as keyword arguments of ``Session.client``."""
        return {n: getattr(self, n) for n in CREDENTIALS if getattr(self, n) is not None}


def _check_credentials(cfg: S3Config) -> None:
    """Types and combinations of the credential options; messages never quote a value."""
    given = cfg.credentials()
    for name, value in given.items():
        if not isinstance(value, str) or not value:
            raise TypeError(f"{name} must be a non-empty string, got a {type(value).__name__}")
    if ("aws_access_key_id" in given) != ("aws_secret_access_key" in given):
        raise ValueError("aws_access_key_id and aws_secret_access_key must be given together")
    if "aws_session_token" in given and "aws_access_key_id" not in given:
        raise ValueError("aws_session_token needs aws_access_key_id and aws_secret_access_key")
    if given and cfg.session is not None:
        raise ValueError(f"{', '.join(given)} cannot be combined with session: the session holds its credentials")


def _int_in(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be between {lo} and {hi}, got {value}")


def _check_endpoint(url: Any) -> None:
    if not isinstance(url, str):
        raise TypeError(f"endpoint_url must be a string, got {type(url).__name__}")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError("endpoint_url must look like http(s)://host[:port]")
    if parsed.username is not None or parsed.password is not None:
        # Never echo the URL: it holds a secret.
        raise ValueError(
            "endpoint_url must not contain credentials (user:password@): use the standard AWS "
            "credential chain (environment, config file, instance role) or a boto3 session"
        )
