"""Raw tensor bytes without copies: the bridge between tensors and byte buffers.

The goodput format stores every tensor as its C-order, little-endian bytes. For a contiguous CPU tensor
those bytes are already in memory, so the writer hashes and writes slices of them directly and
the reader reads file bytes straight into destination tensors. Anything else (a non-contiguous
view, a tensor on an accelerator) is materialized piece by piece, so that host memory stays
bounded by the in-flight chunks rather than growing with the model.
"""

from __future__ import annotations

import sys
import threading

import torch

from ..errors import CheckpointError

__all__ = ["TensorByteSource", "byte_view", "check_byte_order"]


def check_byte_order() -> None:
    """The goodput format is little-endian; refuse to silently write or read swapped bytes."""
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        raise CheckpointError("the goodput-ckpt format requires a little-endian host")


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable ``memoryview`` over the bytes of a contiguous CPU tensor (no copy)."""
    if t.numel() == 0:
        return memoryview(bytearray(0))
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


class TensorByteSource:
    """Hands out byte ranges of one tensor's C-order representation.

    ``view(start, end)`` may be called from several threads. CPU contiguous tensors are served
    zero-copy. Accelerator tensors are sliced on the device and copied to host one range at a
    time. Non-contiguous CPU tensors are made contiguous once and the copy is dropped when the
    last range has been served (``release``).
    """

    def __init__(self, tensor: torch.Tensor, key: str) -> None:
        self.key = key
        t = _plain(tensor)
        if t.layout != torch.strided:
            raise CheckpointError(f"tensor {key!r} has layout {t.layout}; only dense tensors can be saved", key=key)
        if t.is_quantized:
            raise CheckpointError(f"tensor {key!r} is quantized; quantized tensors cannot be saved", key=key)
        self.nbytes = t.numel() * t.element_size()
        self._tensor: torch.Tensor | None = t
        self._view: memoryview | None = None
        self._lock = threading.Lock()
        if t.device.type == "cpu" and t.is_contiguous():
            self._view = byte_view(t)

    def _materialize(self) -> memoryview | torch.Tensor:
        with self._lock:
            if self._view is not None:
                return self._view
            assert self._tensor is not None, "source used after release"
            t = self._tensor
            if t.device.type == "cpu":
                self._view = byte_view(t.contiguous())
                return self._view
            # Device tensor: keep a contiguous flat byte tensor on the device; slice per range.
            if not t.is_contiguous():
                t = t.contiguous()
            self._tensor = t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)
            return self._tensor

    def view(self, start: int, end: int) -> memoryview:
        src = self._view if self._view is not None else self._materialize()
        if isinstance(src, memoryview):
            return src[start:end]
        return byte_view(src[start:end].cpu())

    def release(self) -> None:
        """Drop references (and any contiguous copy) once every range was written."""
        with self._lock:
            self._view = None
            self._tensor = None
