"""The manager's stager: copies of the state into CPU buffers kept from one save to the next.

Moved here from ``dcp/staging.py``: only the manager uses it, and its deferred copies
(:mod:`.deferred_copy`) belong to the manager's async staging.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Collection, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from ...dcp.staging import aligned_empty, stage_state_dict
from ...errors import CheckpointError
from .deferred_copy import DeferredCopies

__all__ = ["DeferPredicate", "ReusableStager"]

#: ``defer(tensor)``: whether the copy of this source may finish after ``stage`` returned.
DeferPredicate = Callable[[torch.Tensor], bool]


class ReusableStager(AsyncStager):
    """An ``AsyncStager`` that copies into CPU buffers kept from one save to the next.

    Copying into freshly allocated memory costs a page fault per page (here about 5x slower than
    a copy into memory that was touched before), so the first :meth:`stage` allocates one CPU
    buffer per tensor and later calls copy into the same buffers whenever a tensor keeps its
    place in the state dict, its dtype and its shape. Buffers are pinned when CUDA is available
    and the source is a CUDA tensor, and those copies are issued ``non_blocking`` and
    synchronized once at the end.

    Call order, and the guard that keeps a buffer from being overwritten while a save still
    writes it::

        staged = stager.stage(state_dict)      # waits until the previous stage was released
        ... dcp writes ``staged`` in the background ...
        stager.release()                       # the owner calls this once that save is over

    :meth:`stage` marks the buffers busy and :meth:`release` frees them; a second
    :meth:`stage` before the release waits (up to ``timeout_s``) instead of overwriting them.
    Pass the stager to ``dcp.async_save(..., async_stager=stager)`` and call :meth:`release`
    from the future's completion; :class:`~goodput_ckpt.CheckpointManager` does both.

    :meth:`stage_deferred` leaves the copies of chosen sources to a
    :class:`~goodput_ckpt.manager.staging.deferred_copy.DeferredCopies` that other threads finish later
    (``CheckpointManager``'s async staging); the buffers are the same.

    Tensors keep their wrappers: a DTensor is staged as a DTensor with the same spec around a
    CPU buffer, so DCP still plans sharded writes. Values that are not tensors are deep-copied
    on every call (they are small: optimizer hyper-parameters, counters). Tensor subclasses other
    than DTensor are copied to fresh memory with torch's helpers.

    Not picklable and not for the process executor: the buffers live in this process.
    """

    # Staging completes inside ``stage``: DCP has nothing to synchronize afterwards.
    _synchronize_after_execute = False

    def __init__(self, *, timeout_s: float = 1800.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        # Guards ``_busy``; ``stage`` waits on it until the previous save released the buffers.
        self._cond = threading.Condition()
        self._busy = False
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._wrappers: dict[tuple, Any] = {}
        # Set only inside stage_deferred (which holds the busy flag): what may be deferred, and
        # the copies deferred so far.
        self._defer: DeferPredicate | None = None
        self._later: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self._skip: frozenset[str] = frozenset()  # keys left unstaged (stage_deferred's ``skip``)

    @property
    def nbytes(self) -> int:
        """Bytes of CPU memory the stager keeps for reuse."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def buffers(self) -> Mapping[tuple, torch.Tensor]:
        """The kept buffers by source path, a read-only view: the same tensors from save to save
        while the state's shapes and dtypes stay the same (why the stall stays flat)."""
        return MappingProxyType(self._buffers)

    @property
    def busy(self) -> bool:
        """Whether a staged copy is still in use (staged and not yet released)."""
        with self._cond:
            return self._busy

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into the kept buffers and return the staged copy.

        Raises:
            CheckpointError: the previous staged copy was not released within ``timeout_s``.
        """
        return self.stage_deferred(state_dict, None)[0]

    def stage_deferred(
        self, state_dict: dict[str, Any], defer: DeferPredicate | None, skip: Collection[str] = ()
    ) -> tuple[dict[str, Any], DeferredCopies]:
        """Like :meth:`stage`, but the copies of CPU sources for which ``defer`` is true are left
        to a :class:`~goodput_ckpt.manager.staging.deferred_copy.DeferredCopies`: the staged copy is not
        complete (nor may it be written) until its ``finish()`` returned.

        The caller must keep those sources unchanged until then (``CheckpointManager`` holds the
        next optimizer step). Accelerator tensors are always copied here.

        ``skip``: flattened keys (``a.b.0.c``, DCP's) of tensors not copied at all: the staged
        copy holds the live tensor itself, for an incremental save that references those bytes
        in an earlier step and never reads them (its writer refuses to write one:
        ``dcp.references_write``). Their kept buffers stay kept, for the next full save.

        Raises:
            CheckpointError: the previous staged copy was not released within ``timeout_s``.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: not self._busy, timeout=self.timeout_s):
                raise CheckpointError(
                    f"ReusableStager: the previous save still holds the staging buffers after "
                    f"{self.timeout_s:.0f}s; call release() when a save completes"
                )
            self._busy = True
        try:
            buffers: dict[tuple, torch.Tensor] = {}
            wrappers: dict[tuple, Any] = {}
            devices: set[torch.device] = set()
            later: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
            self._defer, self._later, self._skip = defer, later, frozenset(skip)
            staged = self._stage(state_dict, (), buffers, wrappers, devices)
            for device in devices:
                torch.cuda.synchronize(device)
            copies = DeferredCopies(later, timeout_s=self.timeout_s)
        except BaseException:
            self.release()  # or the next save would wait timeout_s for buffers nobody holds
            raise
        finally:
            self._defer, self._later, self._skip = None, None, frozenset()
        # Buffers of tensors that left the state dict are dropped; the rest are kept.
        self._buffers, self._wrappers = buffers, wrappers
        return staged, copies

    def release(self) -> None:
        """Mark the staged copy as no longer in use. Idempotent."""
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def synchronize_staging(self) -> None:
        """Staging is complete when :meth:`stage` returns: nothing to wait for."""

    def close(self) -> None:
        """Drop the kept buffers (a save still running keeps its own references)."""
        self._buffers, self._wrappers = {}, {}

    # -- the copy -----------------------------------------------------------------------------
    def _stage(self, value: Any, path: tuple, buffers: dict, wrappers: dict, devices: set) -> Any:
        if isinstance(value, torch.Tensor):
            return self._stage_tensor(value, path, buffers, wrappers, devices)
        if isinstance(value, dict):
            return {k: self._stage(v, (*path, k), buffers, wrappers, devices) for k, v in value.items()}
        if type(value) in (list, tuple):
            items = [self._stage(v, (*path, i), buffers, wrappers, devices) for i, v in enumerate(value)]
            return items if type(value) is list else tuple(items)
        return copy.deepcopy(value)

    def _stage_tensor(self, t: torch.Tensor, path: tuple, buffers: dict, wrappers: dict, devices: set) -> Any:
        dtensor_cls = _dtensor_class()
        if dtensor_cls is not None and type(t) is dtensor_cls:
            # In-place ops on a DTensor bump its own version counter, not its shard's.
            local = self._copy_into(t._local_tensor, path, buffers, devices, watch=t)
            old = self._wrappers.get(path)
            if old is not None and old._local_tensor is local and old._spec == t._spec:
                wrapper = old
            else:
                wrapper = dtensor_cls(local, t._spec, requires_grad=False)
            wrappers[path] = wrapper
            return wrapper
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return stage_state_dict({"v": t})["v"]  # other subclasses: fresh memory
        return self._copy_into(t, path, buffers, devices)

    def _copy_into(
        self, src: torch.Tensor, path: tuple, buffers: dict, devices: set, watch: torch.Tensor | None = None
    ) -> torch.Tensor:
        src = src.detach()
        if self._skip and ".".join(map(str, path)) in self._skip:
            kept = self._buffers.get(path)
            if kept is not None:
                buffers[path] = kept  # not written now; the next full save copies into it again
            return src
        on_cuda = src.device.type == "cuda"
        buf = self._buffers.get(path)
        if buf is None or buf.dtype != src.dtype or buf.shape != src.shape or (on_cuda and not buf.is_pinned()):
            if on_cuda and torch.cuda.is_available():
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)  # page-aligned already
            else:
                buf = aligned_empty(src.shape, src.dtype)
        buffers[path] = buf
        if src.numel() and self._defer is not None and not on_cuda and self._defer(src):
            name = ".".join(map(str, path))
            self._later.append((name, src, buf, src if watch is None else watch))  # type: ignore[union-attr] - set with _defer
        elif src.numel():
            buf.copy_(src, non_blocking=on_cuda)
            if on_cuda:
                devices.add(src.device)
        return buf


_DTENSOR: list[Any] = []  # the DTensor class, looked up once (None without torch.distributed)


def _dtensor_class():
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover - torch built without distributed
            DTensor = None  # noqa: N806
        _DTENSOR.append(DTensor)
    return _DTENSOR[0]
