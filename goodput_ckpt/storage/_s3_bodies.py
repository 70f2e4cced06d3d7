"""Part bodies of S3 uploads: filling them (copy, blake3, CRC-32 in one pass), their checksum,
and keeping them for reuse. Split from ``_s3_upload`` (which sends them)."""

from __future__ import annotations

import base64
import threading
import zlib
from typing import Any

__all__ = ["BODIES", "FILL_PIECE", "b64", "crc32", "crc32_b64", "fill"]

#: Bytes per step when a part body is filled: the piece is copied, then hashed and CRC-summed from
#: the copy while it is in the CPU cache (an 8 MiB chunk is not). Chosen by measurement
#: (docs/benchmarks.md, "Constants in storage/").
FILL_PIECE = 256 << 10


def _load_crc32() -> Any:
    """ISA-L's CRC-32 (``isal``), else zlib's: the same checksum (S3's ``CRC32``).

    ISA-L folds with carry-less multiplication: about 10x zlib's speed here, and it releases the
    GIL, so parallel part fills scale (measured against ``crc32c`` and ``google-crc32c``, which
    compute S3's ``CRC32C``: docs/benchmarks.md, "S3 checksums").
    """
    try:
        from isal import isal_zlib
    except ImportError:  # pragma: no cover - isal is a dependency; a platform without a wheel
        return zlib.crc32
    return isal_zlib.crc32


#: ``crc32(data, value=0) -> int``, the fastest implementation installed.
crc32 = _load_crc32()


def crc32_b64(data: Any) -> str:
    """The ``x-amz-checksum-crc32`` value of ``data``: its CRC-32, big-endian, base64."""
    return b64(crc32(data))


def b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


def fill(views: list[memoryview], start: int, end: int, into: bytearray, hasher: Any, crc: bool) -> int:
    """Copy bytes ``[start, end)`` of the concatenation of ``views`` into ``into`` (exactly that
    long); ``hasher.update`` (when given) gets them in order. Returns their CRC-32 (0 unless
    ``crc``).

    Piece by piece (:data:`FILL_PIECE`): each piece is hashed and summed from the copy, so the
    digest and the CRC describe the body that is sent. blake3 and the CRC release the GIL.
    """
    out = memoryview(into)
    value = at = pos = 0
    for v in views:
        lo, hi = max(start, pos) - pos, min(end, pos + v.nbytes) - pos
        pos += v.nbytes
        for a in range(lo, hi, FILL_PIECE):
            b = min(hi, a + FILL_PIECE)
            dst = out[at : at + b - a]
            dst[:] = v[a:b]
            at += b - a
            if hasher is not None:
                hasher.update(dst)
            if crc:
                value = crc32(dst, value)
        if pos >= end:
            break
    return value


class _Bodies:
    """Part bodies of finished parts, kept for later parts, files and saves of this process.

    A fresh 8 MiB ``bytearray`` is zero-filled and page-faulted on first touch, which costs more
    than filling it from the tensors (docs/benchmarks.md, "Constants in storage/"); a trainer
    saves again and again, so bodies are kept between saves: at most ``keep`` (the giving
    store's ``max_concurrency``) of each size, the memory an upload holds anyway while it runs.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # upload threads of every sink give bodies back
        self._idle: dict[int, list[bytearray]] = {}
        #: Bodies made fresh because none of their size was idle (what reuse saves; tests read it).
        self.fresh = 0

    def take(self, n: int) -> bytearray:
        with self._lock:
            idle = self._idle.get(n)
            if idle:
                return idle.pop()
            self.fresh += 1
        return bytearray(n)

    def give(self, body: bytearray, keep: int) -> None:
        with self._lock:
            idle = self._idle.setdefault(len(body), [])
            if len(idle) < keep:
                idle.append(body)

    def clear(self) -> None:
        """Drop every kept body (tests; a process that is done saving)."""
        with self._lock:
            self._idle.clear()
            self.fresh = 0


BODIES = _Bodies()
