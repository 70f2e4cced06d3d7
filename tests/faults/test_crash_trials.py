"""SIGKILL of a training job's saving process at random instants, on every backend.

Each trial forks a process (``crash_worker.run``, through the fork server) that restores the
newest complete step under a manager root and saves three more with a
:class:`~goodput_ckpt.CheckpointManager` (async saves, ``keep_last=2``, so every save also
applies retention). The process is killed with SIGKILL:

- at a random delay, by this test (about a third of the trials), or
- at a *crash point*: right after a random occurrence of an instrumented event, by the process
  itself, spread evenly over the phases: **staging** (a tensor copied into the staging
  buffers), **data writes** (a chunk written, a file about to close or closed), **manifest
  commit** (just before the manifest is published; on local disk and volumes, its file just
  created and still empty; just after), and **retention** (retention starting, one file of an
  old step deleted).

After every trial, with the same root carried on to the next trial:

- ``goodput_ckpt.tools.ops.ls`` (verifying every hash) reports each step complete or incomplete,
  never corrupt, and ``CheckpointManager.steps()`` agrees;
- every incomplete step is reported incomplete by ``verify`` and refused by
  ``CheckpointManager.restore(step=...)`` without touching the model (never loaded);
- no step that was complete before the trial, or committed during it, is missing unless
  retention had ``keep_last`` newer complete steps to keep instead (nothing older is lost);
- a step whose save never reached the commit is not complete;
- the newest complete step restores, with exactly the values of that step;
- on S3: every data object that exists under an incomplete step was closed by the writer with
  exactly that size (no multipart upload completed from part of a file);
- on a volume, a kill while the manifest is written leaves a torn one: incomplete to the
  manager too (``commit.record``; test_volume_manager_bugs.py has the small case);
- on S3, the restore aborts the multipart uploads the killed process left open.

Trials per backend: 30, scaled by ``GOODPUT_FAULT_TRIALS`` (see ``_reliability``). The S3 and
volume backends are marked ``slow`` (see ``_BACKENDS``).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _reliability import fault_trials, record
from crash_worker import TrialModel
from helpers.wait import wait_until

from goodput_ckpt import CheckpointError, CheckpointManager, IncompleteCheckpointError
from goodput_ckpt.manager.step_layout import child_uri, parse_step_dir, step_dir_name
from goodput_ckpt.tools import inspect_checkpoint, list_checkpoints, verify_checkpoint

SEED = 80_2024
KEEP_LAST = 2
SAVES = 3  # per trial: each trial writes, commits and retires checkpoints

#: Crash-point events by phase (see crash_worker's table).
PHASE_EVENTS = {
    "staging": ["stage.copy"],
    "data writes": ["write.chunk", "write.closing", "write.close"],
    "manifest commit": ["commit.begin", "commit.record", "commit.done"],
    "retention": ["retention.begin", "retention.delete"],
}
#: The phase a random kill landed in, from the last event before it.
_EVENT_PHASE = {
    "restore.begin": "restore",
    "restore.delete": "restore",
    "restore.done": "staging",
    "save.begin": "staging",
    "stage.copy": "staging",
    "save.returned": "data writes",
    "write.begin": "data writes",
    "write.chunk": "data writes",
    "write.closing": "data writes",
    "write.close": "data writes",
    "commit.begin": "manifest commit",
    "commit.record": "manifest commit",
    "commit.done": "manifest commit",
    "cleanup.delete": "manifest commit",
    "retention.begin": "retention",
    "retention.delete": "retention",
    "write.end": "staging",  # the save thread is done; the caller stages the next step
}


@dataclass
class Backend:
    name: str
    root: str
    options: dict[str, Any]
    kib: int  # model size
    chunk_size: int
    s3: Any = None  # the S3Target, to look at the objects themselves

    def uri(self, step: int) -> str:
        return child_uri(self.root, step_dir_name(step))


@dataclass
class Event:
    name: str
    step: int | None
    t: float
    extra: list[str] = field(default_factory=list)


def read_events(path: Path) -> list[Event]:
    if not path.exists():
        return []
    out = []
    text = path.read_text()
    for line in text[: text.rfind("\n") + 1].splitlines():  # whole lines only (a poll may race a write)
        name, step, t, *extra = line.split()
        out.append(Event(name, None if step == "-" else int(step), float(t), extra))
    return out


#: The local sweep runs in the default selection; S3 (SeaweedFS) and the rclone volume take 2-4x
#: longer per trial (about 2.5 of the default suite's minutes together), so they are ``slow``:
#: tools/run-tests runs them after the default selection, so CI still runs all three.
_BACKENDS = ["local", pytest.param("s3", marks=pytest.mark.slow), pytest.param("volume", marks=pytest.mark.slow)]


@pytest.fixture(params=_BACKENDS)
def backend(request, tmp_path) -> Backend:
    if request.param == "local":
        return Backend("local", str(tmp_path / "root"), {}, kib=1024, chunk_size=64 << 10)
    if request.param == "s3":
        target = request.getfixturevalue("seaweed")  # a fresh bucket on SeaweedFS
        # 6 MiB in 5 MiB chunks (S3's smallest part): each save is a 2-part multipart upload.
        return Backend("s3", target.uri("root"), target.options(), kib=6 << 10, chunk_size=5 << 20, s3=target)
    volume = request.getfixturevalue("rclone_volume")  # skips without FUSE
    return Backend("volume", str(volume.fresh("crash")), {}, kib=1024, chunk_size=128 << 10)


class Trials:
    """Runs the trials of one backend and checks the root after each."""

    def __init__(self, backend: Backend, forker, logs: Path, incremental: bool | int = False) -> None:
        self.b = backend
        self.incremental = incremental
        self.forker = forker
        self.logs = logs
        self.complete: set[int] = set()  # complete after the previous trial

    def launch(self, tag: str, crash: dict | None):
        kwargs = dict(
            options=self.b.options,
            kib=self.b.kib,
            saves=SAVES,
            keep_last=KEEP_LAST,
            chunk_size=self.b.chunk_size,
            crash=crash,
            incremental=self.incremental,
        )
        markers = self.logs / f"{tag}.events"
        child = self.forker.run(
            "crash_worker:run", {"root": self.b.root, "markers": str(markers), **kwargs}, self.logs / f"{tag}.log"
        )
        return child, markers

    def check(self, events: list[Event]) -> tuple[list[str], list[int]]:
        """The violations of the guarantees (see the module docstring), and the incomplete steps."""
        b, bad = self.b, []
        rows = {r.step: r for r in list_checkpoints(b.root, verify=True, **b.options).checkpoints}
        status = {s: r.status for s, r in rows.items()}
        for s, st in status.items():
            if st not in ("complete", "incomplete"):
                bad.append(f"step {s} is {st}: {rows[s].problems}")
        complete = sorted(s for s, st in status.items() if st == "complete")
        incomplete = sorted(s for s, st in status.items() if st == "incomplete")
        committed = {e.step for e in events if e.name == "commit.done"}
        referenced = self._references(complete)
        reached_commit = {e.step for e in events if e.name == "commit.begin"}
        saved = {e.step for e in events if e.name == "save.begin"}
        for s in sorted((self.complete | committed) - set(complete)):
            if sum(c > s for c in complete) < KEEP_LAST or any(s in referenced.get(c, ()) for c in complete):
                bad.append(f"step {s} was complete and is gone, with only {[c for c in complete if c > s]} newer")
        for s in sorted((saved - reached_commit - self.complete) & set(complete)):
            bad.append(f"step {s} is complete although its save never reached the commit")

        mgr = CheckpointManager(b.root, keep_last=KEEP_LAST, timeline=False, **b.options)
        try:
            if mgr.steps() != complete:
                bad.append(f"manager.steps() {mgr.steps()} != complete steps {complete}")
            for s in incomplete:
                if verify_checkpoint(b.uri(s), **b.options).status != "incomplete":
                    bad.append(f"verify does not report step {s} incomplete")
                model = TrialModel(b.kib, frozen=bool(self.incremental))
                try:
                    mgr.restore(s, model=model)
                    bad.append(f"incomplete step {s} was restored")
                except IncompleteCheckpointError:
                    pass
                if any(p.count_nonzero() for p in model.parameters()):
                    bad.append(f"a refused restore of step {s} changed the model")
            if b.s3 is not None:
                # Steps this trial wrote (the others are old steps that retention was deleting).
                bad += self._partial_objects([s for s in incomplete if s in saved], events)
            if complete:
                bad += self._restore_latest(mgr, complete[-1])
                if b.s3 is not None and b.s3.open_uploads():
                    bad.append(f"multipart uploads left open after the restore: {b.s3.open_uploads()}")
            elif self.complete:
                bad.append(f"no complete step left; before the trial: {sorted(self.complete)}")
        except CheckpointError as e:
            bad.append(f"checking the root failed: {type(e).__name__}: {e}")
        finally:
            mgr.close()
        self.complete = set(complete)
        return bad, incomplete

    def _references(self, complete: list[int]) -> dict[int, set[int]]:
        """Complete step -> the steps whose files it references (incremental saves)."""
        out: dict[int, set[int]] = {}
        for s in complete:
            bases = inspect_checkpoint(self.b.uri(s), check_files=False, **self.b.options).bases
            out[s] = {parse_step_dir(n) for n in bases}
        return out

    def _restore_latest(self, mgr: CheckpointManager, latest: int) -> list[str]:
        model = TrialModel(self.b.kib, frozen=bool(self.incremental))
        got = mgr.restore(model=model)  # also removes the incomplete steps, as a restart does
        if got != latest or not model.holds(latest):
            return [f"restore gave step {got} (holds its values: {model.holds(got or 0)}), expected {latest}"]
        if mgr.extra(got) != {"step": got}:
            return [f"step {got} has extra {mgr.extra(got)}"]
        return []

    def _partial_objects(self, incomplete: list[int], events: list[Event]) -> list[str]:
        closed = {(e.step, e.extra[0]): int(e.extra[1]) for e in events if e.name == "write.closing"}
        bad = []
        client = self.b.s3.client()
        prefix = self.b.root.split("/", 3)[3]
        for s in incomplete:
            listing = client.list_objects_v2(Bucket=self.b.s3.bucket, Prefix=f"{prefix}/{step_dir_name(s)}/")
            for obj in listing.get("Contents", ()):
                name = obj["Key"].rsplit("/", 1)[1]
                if name.endswith(".bin") and closed.get((s, name)) != obj["Size"]:
                    bad.append(
                        f"step {s}: object {name} ({obj['Size']} bytes) exists but the writer closed "
                        f"it with {closed.get((s, name))} bytes"
                    )
        return bad


def plans(rng: random.Random, trials: int, counts: Counter) -> list[tuple[str, dict | None]]:
    """(phase, crash point) for each trial, shuffled. Every third trial is a random kill instead:
    ``("random", None)`` during the saves, or ``("random-start", None)`` from the fork on (one in
    four of those: the start-up and the restore)."""
    out: list[tuple[str, dict | None]] = []
    phases = list(PHASE_EVENTS)
    for i in range(trials):
        if i % 3 == 2:
            out.append(("random-start" if i % 12 == 11 else "random", None))
            continue
        phase = phases[(i - i // 3) % len(phases)]
        event = rng.choice([e for e in PHASE_EVENTS[phase] if counts[e]])
        out.append((phase, {"event": event, "n": rng.randint(1, counts[event])}))
    rng.shuffle(out)
    return out


def wait_for(markers: Path, event: str, child, timeout: float = 120.0) -> None:
    """Poll the marker file until ``event`` appears (or the child has exited)."""
    try:
        wait_until(
            lambda: child.exited() or any(e.name == event for e in read_events(markers)), timeout, interval=0.002
        )
    except TimeoutError:
        raise AssertionError(f"no {event} after {timeout} s: {child.log_tail()}") from None


def test_sigkill_at_random_instants(backend, forker, tmp_path):
    _sigkill_trials(backend, forker, tmp_path, fault_trials(30), incremental=False)


def test_sigkill_at_random_instants_with_references(backend, forker, tmp_path):
    """The same with incremental saves (a full save every 3rd): retention then runs with steps
    that reference older ones, and a kill anywhere must still leave every kept step loadable."""
    _sigkill_trials(backend, forker, tmp_path, fault_trials(15), incremental=3)


def _sigkill_trials(backend, forker, tmp_path, trials: int, *, incremental: bool | int) -> None:
    rng = random.Random(f"{SEED}-{backend.name}-{incremental}")
    logs = tmp_path / "logs"
    logs.mkdir()
    runner = Trials(backend, forker, logs, incremental)

    # Calibration: two uninterrupted runs. They leave committed steps; the second (which, like
    # every trial, restores first) gives the duration of a run and of its saves, and how often
    # each event happens in a run: crash points are drawn from those counts.
    for tag in ("calibrate0", "calibrate1"):
        t0 = time.monotonic()
        child, markers = runner.launch(tag, None)
        rc = child.wait(300)
        duration = time.monotonic() - t0
        events = read_events(markers)
        assert rc == 0 and events and events[-1].name == "done", child.log_tail()
        bad, _ = runner.check(events)
        # Incremental saves keep the steps the kept ones reference too.
        assert not bad and (len(runner.complete) == KEEP_LAST or incremental), (bad, runner.complete)
    counts = Counter(e.name for e in events)
    saving = events[-1].t - next(e.t for e in events if e.name == "restore.done")

    injected, recovered, lost, not_reached = 0, 0, 0, 0
    hit: Counter = Counter()
    left_incomplete = 0
    failures: list[str] = []
    for trial, (phase, crash) in enumerate(plans(rng, trials, counts)):
        child, markers = runner.launch(f"trial{trial:03d}", crash)
        if phase == "random-start":
            time.sleep(rng.uniform(0.0, duration))
            child.kill()
        elif phase == "random":
            wait_for(markers, "restore.done", child)
            time.sleep(rng.uniform(0.0, 0.9 * saving))
            child.kill()
        rc = child.wait(300)
        events = read_events(markers)
        killed = rc == -9
        reached = crash is None or sum(e.name == crash["event"] for e in events) >= crash["n"]
        if crash is not None and not reached:
            # The n-th occurrence was drawn from the calibration run's count, and this run made
            # fewer (retention deletes what earlier trials left, which varies): a clean run.
            assert rc == 0, (trial, crash, rc, child.log_tail())
            phase = "crash point not reached"
            not_reached += 1
        elif crash is not None:
            assert killed and events and events[-1].name == crash["event"], (trial, crash, rc, child.log_tail())
        elif killed and events:
            phase = _EVENT_PHASE.get(events[-1].name, "startup")
        elif killed:
            phase = "startup"
        else:
            assert rc == 0, child.log_tail()
            phase = "after the last save"
        bad, incomplete = runner.check(events)
        injected += killed
        if killed:
            hit[phase] += 1
        left_incomplete += bool(incomplete)
        if bad:
            lost += 1
            failures.append(f"trial {trial} ({phase}, {crash or 'random delay'}): {bad}; logs in {logs}")
        elif killed:
            recovered += 1
    record(
        "SIGKILL at random instants (manager: stage, write, commit, retention)"
        + (", incremental saves" if incremental else ""),
        backend.name,
        trials=trials,
        faults_injected=injected,
        detected_or_recovered=recovered,
        data_lost=lost,
        phases=dict(hit),
        left_incomplete=left_incomplete,
    )
    assert not failures, "\n".join(failures)
    assert all(hit[p] for p in PHASE_EVENTS) or trials < 8, f"a phase was never hit: {dict(hit)}"
    assert injected >= trials * 0.8, f"only {injected} of {trials} kills landed during the run"
