"""Building the boto3 client of an S3 store: one shared session, our retries, our integrity scheme.

- One boto3 session per process serves every store without a user session: a new session parses
  botocore's JSON service models again (~0.1 s of CPU per store, which every save and load would
  pay); a shared one parses them once. Sessions are not thread-safe, so clients are built from
  it under a lock, and a process that forked gets its own.
- botocore's retries are off (``_s3_retry`` retries within a time budget and resumes reads).
- botocore adds no checksums of its own: the store sends its CRC-32 headers itself
  (``S3Config.checksums``), and botocore's default would put them in aws-chunked trailers over
  https, which many S3-compatible servers reject.
- Bodies are SHA-256 signed only over plain http without CRCs (then the signature is the only
  check in transit). With CRCs the server checks every body; over https TLS protects it; and
  SHA-256 costs ~680 MiB/s of one core, the largest client cost of a save.
- Explicit credentials (``S3Config.aws_access_key_id`` ...) go to this client only, never into the
  shared session, so stores with different credentials never see each other's.
- An endpoint with ``user:password@`` is refused wherever it came from (the option is checked in
  ``S3Config``; ``AWS_ENDPOINT_URL`` and the config file are checked here), so no message can
  quote a secret.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from ..errors import CheckpointError

if TYPE_CHECKING:
    from ._s3_config import S3Config

__all__ = ["make_client"]

_session_lock = threading.Lock()  # boto3 sessions are not thread-safe: one client at a time
_session: tuple[int, Any] | None = None  # (pid, session): never used across a fork


def make_client(cfg: S3Config, uri: str) -> Any:
    """The client for a store at ``uri`` configured by ``cfg`` (the user's, when given).

    Raises:
        CheckpointError: the resolved endpoint URL contains credentials.
    """
    if cfg.client is not None:
        return cfg.client
    client = _new_client(cfg, sign_payload=False if cfg.checksums else None)
    endpoint = urlparse(str(client.meta.endpoint_url))
    if endpoint.username is not None or endpoint.password is not None:
        raise CheckpointError(
            f"the S3 endpoint for {uri} (from the environment or the AWS config file) contains "
            "credentials (user:password@); use the standard AWS credential chain instead",
            path=uri,
        )
    if endpoint.scheme == "https" and not cfg.checksums:
        client = _new_client(cfg, sign_payload=False)  # TLS protects the body
    return client


def _new_client(cfg: S3Config, *, sign_payload: bool | None) -> Any:
    from botocore.config import Config

    s3_options: dict[str, Any] = {"addressing_style": cfg.addressing_style}
    if sign_payload is not None:
        s3_options["payload_signing_enabled"] = sign_payload
    botocore_config = Config(
        region_name=cfg.region,
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        retries={"total_max_attempts": 1, "mode": "standard"},
        # Part uploads plus the reader's threads; connections are opened on demand.
        max_pool_connections=max(64, 2 * cfg.max_concurrency),
        s3=s3_options,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        tcp_keepalive=True,
    )
    if cfg.session is not None:
        return cfg.session.client("s3", endpoint_url=cfg.endpoint_url, config=botocore_config)
    with _session_lock:
        # Explicit credentials (never combined with a session) override the chain for this client.
        return _default_session().client(
            "s3", endpoint_url=cfg.endpoint_url, config=botocore_config, **cfg.credentials()
        )


def _default_session() -> Any:
    """The boto3 session shared by this process's stores (call with ``_session_lock`` held).

    Credentials come from the standard chain when it is first made; refreshable ones (roles,
    SSO) refresh themselves.
    """
    global _session
    import boto3

    if _session is None or _session[0] != os.getpid():
        _session = (os.getpid(), boto3.session.Session())
    return _session[1]
