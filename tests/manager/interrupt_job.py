"""Subprocess half of test_interrupts.py: a one-process manager interrupted during a save.

Usage: ``python interrupt_job.py ROOT MODE``, MODE one of

- ``sync-sigint``: save step 1, then SIGINT this process while a synchronous save of step 2
  writes its first bytes;
- ``async-sigint``: save step 1, then SIGINT while an async save of step 2 is in flight (the
  main thread is back in the training loop);
- ``async-exit``: save step 1, start an async save of step 2 and let the script end with it in
  flight, without ``close()``;

In both async modes the save thread holds back its writes until the interpreter has begun to
exit (:func:`write_after_exit_began`), where Python's thread pools are about to refuse work.
- ``async-abandon``: as ``async-exit``, but the first data write of step 2 takes 8 s and the
  manager's ``timeout_s`` is 1 s, so the exit gives up on it.

The SIGINT is raised from inside the save's first data write (the store's ``write_at``), so it
always lands while the save is in flight. ``ROOT/state.pt`` gets the model's state of step 1.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

from goodput_ckpt import CheckpointManager
from goodput_ckpt.storage import local_sink


def interrupt_at_first_write(sig: bool = True, pause: float = 0.5) -> threading.Event:
    """SIGINT this process (``sig``) from inside the first data write, which then takes
    ``pause`` seconds more; the event is set once it started."""
    sent = threading.Event()
    write_hashed = local_sink.LocalSink.write_hashed  # every chunk's write, direct or buffered

    def interrupting(self, offset, buffers, hasher):
        if not sent.is_set():
            sent.set()
            if sig:
                os.kill(os.getpid(), signal.SIGINT)
            time.sleep(pause)  # still writing when the main thread takes the interrupt
        return write_hashed(self, offset, buffers, hasher)

    local_sink.LocalSink.write_hashed = interrupting
    return sent


def write_after_exit_began(sig: bool) -> None:
    """The save thread, before its writes: SIGINT this process (``sig``), then wait until the
    interpreter has begun to exit (and a little more, for the exit hooks registered before the
    manager's to run), so that every write is handed to a thread pool after that."""
    from goodput_ckpt.manager.staging.confirmed_writer import ConfirmedWriter

    plan = ConfirmedWriter.prepare_local_plan

    def held(self, p):
        if sig:
            os.kill(os.getpid(), signal.SIGINT)
        for _ in range(600):
            if getattr(threading, "_SHUTTING_DOWN", False):
                break
            time.sleep(0.05)
        time.sleep(0.2)
        return plan(self, p)

    ConfirmedWriter.prepare_local_plan = held


def main(root: str, mode: str) -> None:
    # Python installs its KeyboardInterrupt handler only if SIGINT was not ignored at startup, and
    # a test run started in the background by a non-interactive shell (`pytest ... &`) ignores
    # SIGINT and passes that on: a job in a terminal has the handler, so this one does too.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    timeout_s = 1.0 if mode == "async-abandon" else 600.0
    mgr = CheckpointManager(root, async_save=mode != "sync-sigint", keep_last=None, timeout_s=timeout_s)
    mgr.save(1, model=model)
    mgr.wait()
    torch.save(model.state_dict(), os.path.join(root, "state.pt"))
    with torch.no_grad():
        model.weight.add_(1.0)
    if mode in ("async-exit", "async-abandon"):
        if mode == "async-exit":
            write_after_exit_began(sig=False)
        if mode == "async-abandon":
            interrupt_at_first_write(sig=False, pause=8.0)
        mgr.save(2, model=model)
        print("IN FLIGHT", flush=True)
        return  # no close(): the interpreter exits with the save in flight
    sent = interrupt_at_first_write() if mode == "sync-sigint" else threading.Event()
    if mode == "async-sigint":
        write_after_exit_began(sig=True)
    mgr.save(2, model=model)
    print("SAVE RETURNED", flush=True)
    for _ in range(1000):  # the training loop goes on until the interrupt arrives
        time.sleep(0.01)
    print("NO INTERRUPT", sent.is_set(), flush=True)  # the test fails: the exit code is 0


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
