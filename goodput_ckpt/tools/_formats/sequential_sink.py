"""In-order writes of any size, turned into what a store's sink accepts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...storage import Store

__all__ = ["SequentialSink"]


class SequentialSink:
    """A store sink written front to back in writes of any size.

    Why: the DCP and safetensors writers produce their files in order but in pieces of any
    length (a header, a ``torch.save`` archive). Stores that upload each part as a separate
    request (S3) take only whole, aligned parts (``Store.open_sink``'s ``part_size`` promise).
    Here the pieces are gathered into one reused part-sized buffer, each full part is handed
    on, and the rest goes at :meth:`close`; memory stays at one part. Stores without a part
    minimum get every write as it comes.
    """

    #: The part size aimed at where the store has a minimum: a multiple of that minimum.
    PART_BYTES = 8 << 20

    def __init__(self, store: Store, name: str) -> None:
        minimum = store.traits.min_part_size
        self._unit = minimum * -(-self.PART_BYTES // minimum) if minimum else 0
        self._sink = store.open_sink(name, part_size=self._unit or None)
        self._where = f"{store.uri.rstrip('/')}/{name}"
        self._buf = bytearray(self._unit)
        self._fill = 0  # bytes of the current part in _buf
        self._base = 0  # file offset of _buf[0]
        self.pos = 0  # bytes written so far: the next write's offset

    def write_at(self, offset: int, buffers: Sequence[Any]) -> None:
        if offset != self.pos:
            raise RuntimeError(f"{self._where}: write at {offset}, expected {self.pos} (writes must be in order)")
        views = [memoryview(b).cast("B") for b in buffers]
        self.pos += sum(v.nbytes for v in views)
        if not self._unit:
            self._sink.write_at(offset, views)
            return
        for v in views:
            while v.nbytes:
                n = min(v.nbytes, self._unit - self._fill)
                self._buf[self._fill : self._fill + n] = v[:n]
                self._fill += n
                v = v[n:]
                if self._fill == self._unit:
                    self._sink.write_at(self._base, [self._buf])  # the sink copies it out
                    self._base += self._unit
                    self._fill = 0

    def close(self) -> None:
        if self._unit and (self._fill or self._base == 0):
            self._sink.write_at(self._base, [memoryview(self._buf)[: self._fill]])
            self._fill = 0
        self._sink.close()

    def abort(self) -> None:
        self._sink.abort()
