"""A saving process killed with SIGKILL at random moments.

A crash at any instant must leave a location either committed (its manifest valid, its data
verifying) or visibly incomplete, and must never touch an earlier checkpoint. Each trial runs
``save_worker.py`` in a subprocess saving a ~256 MiB state dict and SIGKILLs it at a random
moment of one of four phases (seeded): *early* (a few ms after start: before or while the
location is prepared and an old checkpoint cleared), *write* (once a random fraction of the data
is on disk), *commit* (as soon as the manifest's temporary file or the new manifest appears:
during the commit or the clean-up after it), or *late* (a random delay after the data is all
written: fsync, commit, clean-up, or after the end). Phases are found by watching the files, so a
busy machine does not shift the kills. Then every location is loaded with verification on.

Two cases alternate:
- a new location, with the previous checkpoint elsewhere (which must stay intact);
- ``overwrite=True`` over a committed checkpoint at the same location: the location may hold
  the old checkpoint, the new one, or be incomplete; never a mix, never wrong values.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.wait import wait_until
from torch.distributed.checkpoint.api import CheckpointException

from goodput_ckpt import CheckpointNotFoundError, CheckpointReader, IncompleteCheckpointError
from goodput_ckpt.format.manifest import MANIFEST_NAME

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "save_worker.py")
_spec = importlib.util.spec_from_file_location("save_worker", WORKER)
_worker_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_worker_module)
expected_tensor, layout = _worker_module.expected_tensor, _worker_module.layout
MIB = 256
SEED = 20240607
#: Seconds a wait for the worker may take before the test fails (it never should).
TIMEOUT_S = 300
#: Kill phases of the 6 trials of each case (their order is shuffled with the seed).
PHASES = ["early", "write", "write", "write", "commit", "late"]


class Worker:
    """One save in a subprocess. The constructor returns once the worker has built its state
    dict (so interpreter start-up is not part of any kill timing)."""

    def __init__(self, loc: str, version: int, log: str, *, overwrite: bool = False) -> None:
        args = [sys.executable, WORKER, loc, str(version), "--mib", str(MIB)]
        if overwrite:
            args.append("--overwrite")
        self._log = open(log, "w")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._log, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "READY":
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"save worker did not start: {line!r}; see {log}")

    def finish(self, timeout: float = 120) -> float:
        out, _ = self.proc.communicate(timeout=timeout)
        self._log.close()
        assert self.proc.returncode == 0, f"save failed (rc {self.proc.returncode}); see {self._log.name}"
        return float(out.split()[-1])

    def kill(self) -> bool:
        """SIGKILL the worker now; return whether its save had already finished."""
        self.proc.kill()  # SIGKILL, to this process only
        out, _ = self.proc.communicate(timeout=60)
        self._log.close()
        return "SAVED" in out

    def wait_written(self, loc: str, old: set[str], target: int) -> None:
        """Poll until this save's data files (those not in ``old``) reach ``target`` bytes (the
        file size is the highest offset written so far), or the worker exits."""
        wait_until(lambda: self.proc.poll() is not None or written(loc, old) >= target, TIMEOUT_S, interval=0.0005)

    def wait_commit(self, loc: str) -> None:
        """Poll until the commit starts (a temporary manifest) or is done (a manifest other
        than the one there now), or the worker exits."""
        before = manifest_id(loc)

        def committing() -> bool:
            names = listing(loc)
            return any(n.startswith(f".{MANIFEST_NAME}.tmp") for n in names) or manifest_id(loc) not in (None, before)

        wait_until(lambda: self.proc.poll() is not None or committing(), TIMEOUT_S, interval=0.0002)

    def stop(self) -> None:
        """Make sure the worker is gone (after a failed assertion)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


def written(loc: str, old: set[str]) -> int:
    total = 0
    try:
        names = os.listdir(loc)
    except FileNotFoundError:
        return 0
    for name in names:
        if name.endswith(".bin") and name not in old:
            try:
                total += os.stat(os.path.join(loc, name)).st_size
            except FileNotFoundError:
                pass
    return total


def manifest_id(loc: str) -> tuple[int, int] | None:
    try:
        st = os.stat(os.path.join(loc, MANIFEST_NAME))
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def listing(loc: str) -> set[str]:
    return set(os.listdir(loc)) if os.path.isdir(loc) else set()


def classify(loc: str, allowed: set[int]) -> int | str:
    """Load ``loc`` with verification: the version it holds (which must be one of ``allowed``,
    with exactly that version's values), or ``"incomplete"`` / ``"empty"``."""
    try:
        CheckpointReader(loc).read_metadata()
    except IncompleteCheckpointError:
        outcome = "incomplete"
    except CheckpointNotFoundError:
        outcome = "empty"
    else:
        sizes = layout(MIB)
        dest: dict[str, object] = {k: torch.empty(n) for k, n in sizes.items()}
        dest["step"] = None
        dcp.load(dest, storage_reader=CheckpointReader(loc))  # verify=True: raises if corrupt
        version = dest["step"]
        assert version in allowed, f"{loc} holds version {version!r}, expected one of {allowed}"
        for k, n in sizes.items():
            assert torch.equal(dest[k], expected_tensor(k, n, version)), f"{loc}: wrong values in {k}"
        return version
    # Not committed: a load must refuse it too (never fall back to stray data files).
    with pytest.raises(CheckpointException):
        dcp.load({"model.small0": torch.empty(257), "step": None}, storage_reader=CheckpointReader(loc))
    return outcome


def snapshot(loc: str) -> dict[str, tuple[int, int]]:
    stats = {n: os.stat(os.path.join(loc, n)) for n in os.listdir(loc)}
    return {n: (st.st_size, st.st_mtime_ns) for n, st in stats.items()}


@pytest.fixture
def workers():
    started: list[Worker] = []
    yield started
    for w in started:
        w.stop()


@pytest.mark.slow  # 35-45 s on an idle 2-core machine, over a minute when it is shared
def test_sigkill_during_save(tmp_path, workers):
    rng = random.Random(SEED)
    logs = tmp_path / "logs"
    logs.mkdir()
    prev, same = str(tmp_path / "prev"), str(tmp_path / "same")

    # Calibration: a complete save (version 0) that is also the previous checkpoint. It measures
    # the tail of a save: from "all data written" to done (fsync, commit, clean-up).
    worker = Worker(prev, 0, str(logs / "calibrate.log"))
    workers.append(worker)
    data_bytes = sum(layout(MIB).values()) * 4  # float32 tensors: a lower bound of the file size
    worker.wait_written(prev, set(), data_bytes)
    t_full = time.perf_counter()
    duration = worker.finish()
    # (bounded by the save's own duration: the parent's clock also counts the worker's exit)
    tail = max(0.02, min(duration, time.perf_counter() - t_full))
    assert classify(prev, {0}) == 0
    shutil.copytree(prev, same)  # the committed checkpoint that the overwrite trials replace
    prev_files = snapshot(prev)
    with open(os.path.join(prev, MANIFEST_NAME), "rb") as f:
        prev_manifest = f.read()

    trials = [(overwrite, phase) for overwrite in (False, True) for phase in PHASES]
    rng.shuffle(trials)
    committed_same: int | None = 0  # the version committed at `same`, None when incomplete
    outcomes = []
    for trial, (overwrite, phase) in enumerate(trials):
        version = trial + 1
        loc = same if overwrite else str(tmp_path / f"new{trial}")
        old = listing(loc)
        worker = Worker(loc, version, str(logs / f"trial{trial}.log"), overwrite=overwrite)
        workers.append(worker)
        if phase == "early":
            moment = rng.uniform(0.0, 0.03)
            time.sleep(moment)
        elif phase == "write":
            moment = rng.uniform(0.02, 0.98)
            worker.wait_written(loc, old, int(moment * data_bytes))
        elif phase == "commit":
            moment = 0.0
            worker.wait_commit(loc)
        else:
            moment = rng.uniform(0.0, tail)
            worker.wait_written(loc, old, data_bytes)
            time.sleep(moment)
        finished = worker.kill()
        if overwrite:
            allowed = {version} | ({committed_same} if committed_same is not None else set())
        else:
            allowed = {version}
        outcome = classify(loc, allowed) if os.path.exists(loc) else "empty"
        if finished:
            assert outcome == version, f"trial {trial}: the save reported success but left {outcome!r}"
        if phase == "write":  # killed with data still missing: it cannot have committed
            assert outcome in ("incomplete", "empty") and not finished, (trial, outcome)
        if overwrite:
            committed_same = outcome if isinstance(outcome, int) else None
        else:
            shutil.rmtree(loc, ignore_errors=True)
        outcomes.append((trial, "overwrite" if overwrite else "new", phase, round(moment, 3), finished, outcome))
        # The previous checkpoint is untouched, byte for byte.
        assert snapshot(prev) == prev_files, f"trial {trial} changed {prev}"

    with open(os.path.join(prev, MANIFEST_NAME), "rb") as f:
        assert f.read() == prev_manifest
    assert classify(prev, {0}) == 0  # and still loads, verified
    print(f"save {duration:.2f} s, tail {tail:.3f} s; (trial, case, phase, moment, finished, outcome): {outcomes}")
