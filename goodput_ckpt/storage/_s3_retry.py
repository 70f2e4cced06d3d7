"""Retries for S3 requests: which failures are transient, how long to back off, when to give up.

botocore's own retries are switched off in the clients this package creates (they stop after a
fixed count, not after a time budget, and cannot resume a half-read body). Here every request is
retried with *full jitter* exponential backoff (a random delay in ``[0, min(cap, base * 2**n)]``,
which spreads out the clients that a throttling server slowed down at the same moment) until it
succeeds, fails permanently, runs out of attempts, or would run past its time budget.

Transient: HTTP 5xx and 429, throttling codes (``SlowDown`` ...), connection errors (refused,
reset, closed), connect and read timeouts (a stalled response), a body that ends early, and a
body the server found damaged (``BadDigest``: its CRC-32 or SHA-256 did not match).
Permanent: everything else (403, 404, 400 ...): retrying those only delays the real error.

Messages name the request and the object and describe the cause from its error code, HTTP status
and the server's message only, never from the whole response (some servers echo the access key
id in a ``SignatureDoesNotMatch`` body).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import CheckpointError
from .base import redact

__all__ = [
    "RetryPolicy",
    "call_with_retries",
    "client_error_code",
    "describe",
    "is_no_such_upload",
    "is_not_found",
    "is_transient",
    "is_transient_code",
]

log = logging.getLogger("goodput_ckpt.storage.s3")

T = TypeVar("T")

#: Error codes S3 and compatible servers use for throttling or a transient server-side fault.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "BandwidthLimitExceeded",
        "ConditionalRequestConflict",  # another conditional write to the key is in progress
        "BadDigest",
        "XAmzContentSHA256Mismatch",  # the body was damaged in transit: send it again
    }
)


@dataclass(frozen=True)
class RetryPolicy:
    """How one request is retried (built from :class:`~goodput_ckpt.storage.S3Config`).

    Attributes:
        max_attempts: attempts in all, the first included.
        time_limit: seconds from the first attempt after which no new attempt starts. A running
            attempt is bounded by the client's connect and read timeouts.
        base_delay: backoff before the second attempt, doubled for each later one (before jitter).
        max_delay: cap on a single backoff.
    """

    max_attempts: int
    time_limit: float
    base_delay: float = 0.1
    max_delay: float = 5.0


def client_error_code(exc: BaseException) -> tuple[str, int]:
    """``(error code, HTTP status)`` of a botocore ``ClientError`` (``("", 0)`` for others)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return "", 0
    err = response.get("Error") or {}
    meta = response.get("ResponseMetadata") or {}
    return str(err.get("Code") or ""), int(meta.get("HTTPStatusCode") or 0)


def is_not_found(exc: BaseException) -> bool:
    """Whether ``exc`` says the object does not exist (not the bucket: that is a setup error).

    S3 says ``NoSuchKey`` to GETs; HEAD responses have no body, so botocore makes the code
    ``"404"`` or ``"NotFound"``; some servers send only the status.
    """
    code, status = client_error_code(exc)
    if code == "NoSuchBucket":
        return False
    return code in ("NoSuchKey", "NotFound", "404") or status == 404


def is_no_such_upload(exc: BaseException) -> bool:
    """Whether ``exc`` says the multipart upload is gone (completed or aborted meanwhile)."""
    return client_error_code(exc)[0] == "NoSuchUpload"


def is_transient_code(code: str) -> bool:
    """Whether an S3 error code (of a request, or of one key in a ``DeleteObjects`` answer) is
    worth retrying."""
    return code in _TRANSIENT_CODES


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the request that raised ``exc`` may succeed."""
    from botocore.exceptions import (
        ClientError,
        HTTPClientError,
        IncompleteReadError,
        ResponseStreamingError,
        SSLError,
    )

    if isinstance(exc, ClientError):
        code, status = client_error_code(exc)
        return status >= 500 or status == 429 or code in _TRANSIENT_CODES
    if isinstance(exc, SSLError):
        return False  # a certificate problem does not go away by itself
    if isinstance(exc, (HTTPClientError, ResponseStreamingError, IncompleteReadError)):
        return True  # connection refused/reset/closed, timeouts, a body cut short
    return isinstance(exc, (ConnectionError, TimeoutError))


def describe(exc: BaseException) -> str:
    """A one-line cause for messages: code, status and server message, or the client error.

    Connection errors quote the endpoint URL; any ``user:password@`` in it is masked (an
    endpoint from the environment is not validated like the ``endpoint_url`` option).
    """
    code, status = client_error_code(exc)
    if code or status:
        message = str(((getattr(exc, "response", None) or {}).get("Error") or {}).get("Message") or "")
        text = f"{code or 'error'} (HTTP {status})" + (f": {message[:300]}" if message else "")
    else:
        text = f"{type(exc).__name__}: {str(exc)[:300]}"
    return redact(text)


def call_with_retries(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    what: str,
    where: str,
    stop: threading.Event | None = None,
    translate: Callable[[BaseException], BaseException | None] | None = None,
) -> T:
    """Run ``fn`` until it succeeds, retrying transient failures within ``policy``.

    Args:
        fn: one attempt (it may keep progress between attempts, e.g. bytes already read).
        what: the request, for messages ("uploading part 3 of").
        where: the object, for messages ("s3://bucket/key").
        stop: when set (another part of the same file failed), no further attempt starts.
        translate: maps a permanent error to the exception to raise (e.g. 404 to
            ``IncompleteCheckpointError``); ``None`` means the generic ``CheckpointError``.

    Raises:
        CheckpointError: the last failure, naming ``what``, ``where``, the attempts and the cause.
    """
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - classified below, re-raised as CheckpointError
            elapsed = time.monotonic() - start
            if not is_transient(e):
                mapped = translate(e) if translate is not None else None
                if mapped is not None:
                    raise mapped from e
                raise CheckpointError(f"{what} {where} failed: {describe(e)}", path=where) from e
            delay = random.uniform(0.0, min(policy.max_delay, policy.base_delay * 2 ** (attempt - 1)))
            stopped = stop is not None and stop.is_set()
            if stopped or attempt >= policy.max_attempts or elapsed + delay > policy.time_limit:
                why = (
                    "another part of the same file failed"
                    if stopped
                    else f"gave up after {attempt} attempt(s) in {elapsed:.1f}s "
                    f"(limits: {policy.max_attempts} attempts, {policy.time_limit:g}s)"
                )
                raise CheckpointError(f"{what} {where} failed: {describe(e)}; {why}", path=where) from e
            log.debug("retrying %s %s in %.2fs (attempt %d): %s", what, where, delay, attempt, describe(e))
            if stop is None:
                time.sleep(delay)
            elif stop.wait(delay):
                raise CheckpointError(
                    f"{what} {where} failed: {describe(e)}; another part of the same file failed", path=where
                ) from e
