"""Aborting the multipart uploads that killed saves left open under an S3 location.

A process killed mid-save (SIGKILL, a lost node) cannot abort its uploads: their parts stay
stored and billed, invisible to listings of objects, until someone aborts them (or a bucket
lifecycle rule does). An upload counts as stale when it has been idle for ``older_than``
seconds: neither started nor given a part for that long. Idle is judged by the server's clock
(the ``Date`` of the listing against the server's own ``Initiated`` and part ``LastModified``
times), so a skewed client clock changes nothing. A live upload gets a part every few seconds;
one that got none for minutes belongs to a writer that is gone or far past its retry budget.

Only uploads under ``prefix/`` are touched (``prefix/`` with its slash: ``run/step_1`` never
reaches ``run/step_10``), and by default only files directly under it, never nested locations.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any

from ._s3_retry import is_no_such_upload
from ._s3_upload import ignore_no_such_upload

if TYPE_CHECKING:
    from .s3 import S3Store

__all__ = ["abort_stale_uploads"]

log = logging.getLogger("goodput_ckpt.storage.s3")


def abort_stale_uploads(store: S3Store, *, older_than: float, recursive: bool = False) -> list[str]:
    """Abort the uploads under ``store``'s location idle for ``older_than`` seconds (see
    :meth:`~goodput_ckpt.storage.S3Store.abort_stale_uploads`); returns their keys."""
    if isinstance(older_than, bool) or not isinstance(older_than, (int, float)) or older_than < 0:
        raise ValueError(f"older_than must be a number of seconds >= 0, got {older_than!r}")
    client, bucket = store.client(), store.bucket
    base = f"{store.prefix}/" if store.prefix else ""
    aborted: list[str] = []
    seen: set[tuple[str, str]] = set()
    markers: dict[str, str] = {}
    while True:
        kwargs = {"Bucket": bucket, "Prefix": base, **markers}
        page = store.call("listing the multipart uploads under", base, lambda: client.list_multipart_uploads(**kwargs))
        cutoff = _server_now(page) - timedelta(seconds=older_than)
        fresh = [u for u in page.get("Uploads", ()) if (u["Key"], u["UploadId"]) not in seen]
        for upload in fresh:
            key, upload_id = upload["Key"], upload["UploadId"]
            seen.add((key, upload_id))
            rest = key[len(base) :]
            if not key.startswith(base) or not rest or (not recursive and "/" in rest):
                continue  # a nested location (or a server that ignores Prefix)
            if not _idle(store, upload, cutoff):
                continue
            store.call(
                "aborting the stale multipart upload of",
                key,
                lambda: ignore_no_such_upload(
                    lambda: client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
                ),
            )
            aborted.append(key)
            log.info("aborted a stale multipart upload of %s (idle for over %s s)", store.where(key), older_than)
        if not page.get("IsTruncated") or not fresh:
            return aborted
        # Some servers (SeaweedFS) send no NextKeyMarker: the last upload listed is the marker.
        markers = {
            "KeyMarker": page.get("NextKeyMarker") or fresh[-1]["Key"],
            "UploadIdMarker": page.get("NextUploadIdMarker") or fresh[-1]["UploadId"],
        }


def _server_now(response: dict[str, Any]) -> datetime:
    """The server's time when it answered (its ``Date`` header), else this machine's."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        if date:
            return parsedate_to_datetime(date)
    except (TypeError, ValueError):
        pass
    return datetime.now(timezone.utc)


def _idle(store: S3Store, upload: dict[str, Any], cutoff: datetime) -> bool:
    """Whether ``upload`` neither started nor got a part after ``cutoff`` (and still exists)."""
    if _aware(upload.get("Initiated")) > cutoff:
        return False
    client, key = store.client(), upload["Key"]
    kwargs: dict[str, Any] = {"Bucket": store.bucket, "Key": key, "UploadId": upload["UploadId"]}

    def list_parts() -> dict[str, Any] | None:
        try:
            return client.list_parts(**kwargs)
        except Exception as e:
            if is_no_such_upload(e):  # completed or aborted meanwhile
                return None
            raise

    while True:
        page = store.call("listing the parts of", key, list_parts)
        if page is None:
            return False
        if any(_aware(part.get("LastModified")) > cutoff for part in page.get("Parts", ())):
            return False
        marker = page.get("NextPartNumberMarker")
        if not page.get("IsTruncated") or not marker or marker == kwargs.get("PartNumberMarker"):
            return True
        kwargs["PartNumberMarker"] = marker


def _aware(when: Any) -> datetime:
    """A timezone-aware time (botocore parses S3's times as such); the epoch when missing."""
    if not isinstance(when, datetime):
        return datetime.fromtimestamp(0, timezone.utc)
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)
