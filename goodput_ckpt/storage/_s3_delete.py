"""Deleting many objects of an S3 location in few requests: ``DeleteObjects``, 1,000 keys each.

Why: retention deletes a whole step, one data file per rank (16,385 objects at 16,384 ranks).
One ``DeleteObject`` each is 16,385 sequential requests (minutes in the save thread); batches of
1,000 are 17.

A batch answers per key: each key is deleted or has its own error. Keys that failed with a
transient code (``InternalError``, ``SlowDown`` ...) are sent again, with the same backoff and
budget as a failed request (``_s3_retry``); a key that S3 says does not exist counts as deleted
(deleting a missing file is not an error); any other per-key error (``AccessDenied``) is
permanent and raised as a :class:`~goodput_ckpt.errors.CheckpointError` naming the keys.
Batches are sent one after the other, in the order given. A server that does not implement
``DeleteObjects`` (HTTP 501) gets one ``DeleteObject`` per key instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ._s3_retry import client_error_code, is_transient_code
from .base import redact

if TYPE_CHECKING:
    from .s3 import S3Store

__all__ = ["BATCH", "delete_keys"]

log = logging.getLogger("goodput_ckpt.storage.s3")

#: The most keys S3 accepts in one ``DeleteObjects`` request.
BATCH = 1000

_GONE = ("NoSuchKey", "NotFound", "404")


def delete_keys(store: S3Store, keys: Sequence[str]) -> None:
    """Delete ``keys`` (full object keys) of ``store``'s bucket, ``BATCH`` per request.

    Raises:
        CheckpointError: a request failed after retries, or S3 refused to delete some keys.
    """
    for start in range(0, len(keys), BATCH):
        batch = list(dict.fromkeys(keys[start : start + BATCH]))
        try:
            _delete_batch(store, batch)
        except _NoBatchDelete:
            # A server without DeleteObjects (Google Cloud Storage's XML API, some gateways):
            # one DeleteObject per key, as before batches existed.
            log.info(
                "%s does not support DeleteObjects: deleting %d object(s) one at a time", store.uri, len(keys) - start
            )
            for key in keys[start:]:
                store.call("deleting", key, lambda: store.client().delete_object(Bucket=store.bucket, Key=key))
            return


class _NoBatchDelete(CheckpointError):
    """The server answered ``DeleteObjects`` with ``NotImplemented`` (HTTP 501)."""


def _delete_batch(store: S3Store, keys: list[str]) -> None:
    client = store.client()
    pending = list(keys)

    def attempt() -> None:
        objects = [{"Key": k} for k in pending]
        try:
            resp = client.delete_objects(Bucket=store.bucket, Delete={"Objects": objects, "Quiet": True})
        except Exception as e:
            code, status = client_error_code(e)
            if code == "NotImplemented" or status == 501:  # before the retries (a 5xx is transient)
                raise _NoBatchDelete(f"{store.uri} does not support DeleteObjects") from e
            raise
        errors: list[dict[str, Any]] = [e for e in resp.get("Errors", ()) if str(e.get("Code")) not in _GONE]
        retry = [e for e in errors if is_transient_code(str(e.get("Code")))]
        refused = [e for e in errors if not is_transient_code(str(e.get("Code")))]
        if refused:
            shown = ", ".join(_describe(store, e) for e in refused[:5])
            more = f" and {len(refused) - 5} more" if len(refused) > 5 else ""
            where = store.where(str(refused[0].get("Key")))
            raise CheckpointError(f"deleting {len(refused)} object(s) failed: {shown}{more}", path=where)
        pending[:] = [str(e.get("Key")) for e in retry]
        if pending:
            # Transient per-key failures: raise what call_with_retries retries (the same backoff
            # and budget as a failed request); the next attempt sends only these keys.
            from botocore.exceptions import ClientError

            first = retry[0]
            message = f"{len(pending)} key(s) not deleted: {first.get('Message') or ''}"
            error = {"Code": str(first.get("Code")), "Message": message}
            raise ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": 503}}, "DeleteObjects")

    store.call("deleting", keys[0], attempt)


def _describe(store: S3Store, error: dict[str, Any]) -> str:
    """One key's failure for a message: where, the code and the server's message (bounded and
    with any URL credentials masked, as ``_s3_retry.describe`` does for whole requests)."""
    message = redact(str(error.get("Message") or "")[:200])
    return f"{store.where(str(error.get('Key')))} ({error.get('Code')}: {message})"
