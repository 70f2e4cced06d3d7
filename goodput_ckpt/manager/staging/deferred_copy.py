"""Staging copies left to finish after ``save`` returned, shared by a background and a training thread.

Why: in an async save, copying the parameters and the optimizer state into the staging buffers
is the whole stall, yet nothing changes those tensors until the next optimizer step. The copy
can therefore run behind the next forward and backward. :class:`DeferredCopies` holds such
copies, cut into pieces. Any thread may call :meth:`DeferredCopies.finish`: the save thread does
at once, in the background, and a training thread does when it reaches a point where the
sources are about to change (``CheckpointManager`` hooks every optimizer's step). That thread
then copies what is left itself, with the save thread, so it never waits for more than the rest
of one copy; if the background copy finished first, it does not wait at all.

Nothing else protects the sources. So every source's version counter (bumped by every
in-place operation on a tensor or its views, once the operation has returned) is compared with
the one recorded when the copies were deferred: a source changed in between fails the copies,
and with them the save, instead of letting a checkpoint mix two steps. It is compared when the
last piece is copied, and once more at the last moment that can still fail the save: when a
training thread confirms the copies before the sources may change (:meth:`DeferredCopies.confirm`,
from the optimizer's step pre-hook) or, if that comes later, just before the save commits
(:meth:`DeferredCopies.check_before_commit`). An operation that was still running while its
tensor was copied has returned by then, and shows up. Both take one lock, so the optimizer step
cannot start changing the sources while the save thread compares them. A change through
``.data`` or outside autograd's view tracking bumps no counter and cannot be seen; see
``docs/manager.md``.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence

import torch

from ...errors import CheckpointError

__all__ = ["PIECE_BYTES", "DeferredCopies"]

#: Copies are cut into pieces of at most this size, so that two threads can share the rest of a
#: large tensor and a training thread waits for at most one piece that another thread copies.
PIECE_BYTES = 8 << 20


class DeferredCopies:
    """``dst.copy_(src)`` for each ``(name, src, dst)``, done by whichever threads call :meth:`finish`.

    Call order::

        copies = DeferredCopies([(name, src, dst, watch), ...])   # records each version
        copies.finish()          # any thread, any number of times: returns once all are copied
        copies.confirm()         # the training thread, before the sources may change again
        copies.check_before_commit()   # the saving thread, before it commits
        copies.result()          # raises CheckpointError if a copy failed or a source changed

    Args:
        copies: ``(name, src, dst, watch)``; ``src`` and ``dst`` have the same shape and dtype,
            ``dst`` is on the CPU. ``watch`` is the tensor whose version counter tells whether
            ``src`` changed: ``src`` itself, or for the local shard of a DTensor the DTensor,
            whose in-place operations bump only its own counter.
        timeout_s: the longest :meth:`finish` waits for pieces that another thread copies.
    """

    def __init__(
        self, copies: Sequence[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]], *, timeout_s: float = 1800.0
    ) -> None:
        self.timeout_s = float(timeout_s)
        self.nbytes = sum(src.numel() * src.element_size() for _, src, _, _ in copies)
        self._pieces = [piece for _, src, dst, _ in copies for piece in _pieces(src, dst)]
        self._sources = [(name, watch, _version(watch)) for name, _, _, watch in copies]
        # Set by confirm() (the training thread) / check_before_commit() (the save thread):
        # whichever comes first makes the last comparison of the versions, under _cond.
        self._confirmed = False
        self._final_check_done = not copies
        # Guards the cursor, the count of pieces being copied, the error and the blocked time;
        # ``finish`` waits on it for pieces that another thread is copying.
        self._cond = threading.Condition()
        self._next = 0
        self._copying = 0
        self._blocking_inside = 0
        self._blocked_s = 0.0
        self._done = False
        self._error: BaseException | None = None
        if not self._pieces:
            self._complete()

    @property
    def done(self) -> bool:
        """Whether every piece is copied (or the copies failed)."""
        with self._cond:
            return self._done

    def finish(self, *, blocking_caller: bool = False) -> float:
        """Copy pieces until none is left, then wait for those other threads copy.

        Never raises for a failed copy (see :meth:`result`), so a training thread that calls it
        from a hook is never stopped by a checkpoint's failure.

        Args:
            blocking_caller: the caller is a training thread whose time here counts as stall
                (added to :meth:`blocked_seconds`).

        Returns:
            The seconds spent here.

        Raises:
            CheckpointError: the pieces other threads copy were not done within ``timeout_s``.
            KeyboardInterrupt, SystemExit: raised during a copy in this thread (passed on, so
                Ctrl-C in a training step still stops training; the copies fail with it).
        """
        t0 = time.perf_counter()
        with self._cond:
            if self._done:
                return 0.0
            if blocking_caller:
                self._blocking_inside += 1
        try:
            while (i := self._claim()) is not None:
                dst, src = self._pieces[i]
                err: BaseException | None = None
                try:
                    if blocking_caller or not _copy_on_one_core(dst, src):
                        dst.copy_(src)  # torch's threads: the fastest copy, for a waiting caller
                except BaseException as e:  # noqa: BLE001 - reported by result(), never lost
                    err = e
                self._unclaim(err)
                if err is not None and not isinstance(err, Exception):
                    raise err  # Ctrl-C or SystemExit in the training thread's hook: not a copy failure
            with self._cond:
                if not self._cond.wait_for(lambda: self._done, timeout=self.timeout_s):
                    raise CheckpointError(f"staging copies still running after {self.timeout_s:.0f}s")
        finally:
            spent = time.perf_counter() - t0
            if blocking_caller:
                with self._cond:
                    self._blocked_s += spent
                    self._blocking_inside -= 1
                    self._cond.notify_all()
        return spent

    @property
    def confirmed(self) -> bool:
        """Whether a training thread confirmed the copies."""
        with self._cond:
            return self._confirmed

    def confirm(self) -> float:
        """Finish the copies in this (training) thread and, unless the save thread already did,
        compare the versions for the last time. Idempotent; never raises for a failed copy.

        Call it where the training thread's in-place operations have all returned and before the
        sources may legitimately change (an optimizer's step pre-hook, ``wait_staged``, the next
        save, ``wait``, ``close``): a version that changed since the copies were deferred is then
        an in-place change of the state between ``save`` and the optimizer step, including one
        that was still running while its tensor was copied.

        Returns:
            The seconds spent here.
        """
        with self._cond:
            if self._confirmed:
                return 0.0
        spent = self.finish(blocking_caller=True)
        with self._cond:
            self._final_check()
            self._confirmed = True
        return spent

    def check_before_commit(self) -> None:
        """The save thread's last comparison of the versions, unless the training thread already
        confirmed the copies (then its comparison stands, and the sources may be changing under
        the optimizer step now). Call it after :meth:`finish`, right before committing, then
        :meth:`result`."""
        with self._cond:
            self._final_check()

    def result(self) -> None:
        """Raise the failure of the copies, if any (call after :meth:`finish`).

        Raises:
            CheckpointError: a copy failed, or a source changed before all were copied.
        """
        with self._cond:
            err = self._error
        if isinstance(err, CheckpointError):
            raise err
        if err is not None:
            raise CheckpointError(f"copying the state into the staging buffers failed: {err}") from err

    def blocked_seconds(self) -> float:
        """Seconds that blocking callers spent in :meth:`finish`, once none is still inside."""
        with self._cond:
            self._cond.wait_for(lambda: self._blocking_inside == 0, timeout=self.timeout_s)
            return self._blocked_s

    # -- the shared cursor ----------------------------------------------------------------------
    def _claim(self) -> int | None:
        with self._cond:
            if self._done or self._next >= len(self._pieces):
                return None
            i = self._next
            self._next += 1
            self._copying += 1
            return i

    def _unclaim(self, err: BaseException | None) -> None:
        with self._cond:
            self._copying -= 1
            if err is not None and self._error is None:
                self._error = err
                self._next = len(self._pieces)  # no more pieces: the copies have failed
            last = self._next >= len(self._pieces) and self._copying == 0 and not self._done
        if last:
            self._complete()

    def _complete(self) -> None:
        """Check that no source changed while its copy was deferred, then wake the waiters."""
        self._check_sources()
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def _final_check(self) -> None:
        """Under ``_cond``: the last comparison of the versions, made once."""
        if not self._final_check_done:
            self._final_check_done = True
            self._check_sources()

    def _check_sources(self) -> None:
        """Fail the copies (once) when a source's version changed since they were deferred."""
        changed = [name for name, src, v in self._sources if v is not None and _version(src) != v]
        with self._cond:  # reentrant: _final_check calls it with the lock held
            if changed and self._error is None:
                shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
                self._error = CheckpointError(
                    f"{shown} changed in place after save() returned and before the optimizer's next "
                    "step(); "
                    "the checkpoint would mix two steps, so this save fails. Only an optimizer "
                    "passed to save() may change the state before its next step(); call "
                    "CheckpointManager.wait_staged() before other in-place changes, or pass "
                    "async_staging=False",
                    key=changed[0],
                )


def _copy_on_one_core(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy a contiguous CPU piece with one ``memmove`` (ctypes releases the GIL for it).

    Why not ``copy_``: a background thread that calls torch ops gets its own team of intra-op
    threads, so the training loop's forward and backward would share the cores with a second
    full team; one memmove thread leaves them theirs. Returns ``False`` (nothing copied) for
    pieces it cannot take: another device, dtype or size, or non-contiguous memory.
    """
    if not (
        src.layout == torch.strided
        and dst.layout == torch.strided
        and src.device.type == "cpu"
        and dst.device.type == "cpu"
        and src.dtype == dst.dtype
        and src.numel() == dst.numel()
        and src.is_contiguous()
        and dst.is_contiguous()
    ):
        return False
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    return True


def _version(t: torch.Tensor) -> int | None:
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _pieces(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(dst, src)`` pieces of at most :data:`PIECE_BYTES` (contiguous tensors only)."""
    n = src.numel()
    if n == 0:
        return []
    step = max(1, PIECE_BYTES // src.element_size())
    strided = src.layout == torch.strided and dst.layout == torch.strided
    if n <= step or not (strided and src.is_contiguous() and dst.is_contiguous()):
        return [(dst, src)]
    s, d = src.view(-1), dst.view(-1)
    return [(d[i : i + step], s[i : i + step]) for i in range(0, n, step)]
