"""The fault proxy of tests/helpers/s3.py with one more action: ``truncate_request``.

A request body cut short on its way to the server, with a ``Content-Length`` that matches what
is left (what a broken middlebox or client stream produces): the server receives a well-formed
request for fewer bytes than the client meant to send. Only a checksum of the body (CRC-32,
SHA-256, MD5) lets the server notice; otherwise it stores the short part or object.

Everything else is :class:`helpers.s3.FaultProxy` unchanged; the new action reuses its ``corrupt``
path (forward a changed body) with the cut instead of the bit flip.
"""

from __future__ import annotations

import threading

from helpers import s3 as _s3

__all__ = ["TruncatingProxy"]

_cut = threading.local()  # per handler thread: the request being handled is to be cut


class _Server(_s3._ProxyServer):
    def pick(self, op: str, key: str, headers) -> str | None:
        action = super().pick(op, key, headers)
        _cut.on = action == "truncate_request"
        return "corrupt" if _cut.on else action


class _Handler(_s3._Handler):
    def _forward(self, body: bytes):
        if getattr(_cut, "on", False):
            _cut.on = False
            body = body[: len(body) // 2]  # the "corrupt" path flipped a bit in the second half
            self.headers.replace_header("Content-Length", str(len(body)))
        return super()._forward(body)


class TruncatingProxy(_s3.FaultProxy):
    """:class:`helpers.s3.FaultProxy` that also knows ``add("truncate_request", ...)``."""

    def __init__(self, upstream_url: str, *, seed: int = 0) -> None:  # noqa: D107 - as FaultProxy's
        super().__init__(upstream_url, seed=seed)
        # The running server gains the action: one more case in ``pick`` and in the handler
        # (both looked up per request, before any request can arrive).
        self._server.__class__ = _Server
        self._server.RequestHandlerClass = _Handler
