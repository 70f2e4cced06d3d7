"""Two writers aimed at one location, and a reader racing a writer, on local disk and S3.

**Two writers** (two processes, released together, each after its own random skew of 0-40 ms,
so the trials cover every interleaving: one refused before it writes, both writing at once,
both reaching the commit together): exactly one commits; the other fails with
:class:`~goodput_ckpt.CheckpointExistsError`, and the location verifies and holds exactly the
committed writer's state, never a mix.

**A reader racing a writer**: while one process saves, this test polls the location as fast as
it can (``CheckpointReader.read_metadata``, then a full verified ``dcp.load``). Every look sees
nothing (``CheckpointNotFoundError``), an uncommitted save (``IncompleteCheckpointError``), or
the whole committed checkpoint with exactly the writer's values: never a partial one.

Trial counts scale with ``GOODPUT_FAULT_TRIALS`` (see ``_reliability``).
"""

from __future__ import annotations

import json
import random
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _reliability import fault_trials, record
from concurrent_worker import writer_state
from helpers.trees import zeros_like
from helpers.wait import wait_until
from torch.distributed.checkpoint.api import CheckpointException

from goodput_ckpt import CheckpointNotFoundError, CheckpointReader, IncompleteCheckpointError
from goodput_ckpt.errors import find_checkpoint_error
from goodput_ckpt.tools import verify_checkpoint

SEED = 5_005


@dataclass
class Where:
    backend: str
    make_uri: Any  # name -> uri
    options: dict[str, Any]
    mib: int
    chunk_size: int


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path) -> Where:
    if request.param == "local":
        return Where("local", lambda name: str(tmp_path / "locations" / name), {}, mib=4, chunk_size=256 << 10)
    target = request.getfixturevalue("seaweed")  # a fresh bucket on SeaweedFS
    return Where("s3", target.uri, target.options(), mib=8, chunk_size=5 << 20)


def start_writers(forker, where: Where, loc: str, tmp: Path, tag: str, skews: dict[int, float]) -> list:
    """Fork one writer per ``seed: skew``, wait until each has built its state, release them
    together; returns ``(child, result file)`` per writer."""
    go = tmp / f"{tag}.go"
    started = []
    for seed, skew in skews.items():
        ready, out = tmp / f"{tag}-{seed}.ready", tmp / f"{tag}-{seed}.json"
        kwargs = dict(
            location=loc,
            options=where.options,
            seed=seed,
            mib=where.mib,
            chunk_size=where.chunk_size,
            ready=str(ready),
            go=str(go),
            out=str(out),
            skew=skew,
        )
        started.append((forker.run("concurrent_worker:save_when_told", kwargs, tmp / f"{tag}-{seed}.log"), ready, out))
    children = [c for c, _, _ in started]

    def all_ready() -> bool:
        if all(ready.exists() for _, ready, _ in started):
            return True
        assert not any(c.exited() for c in children), [c.log_tail() for c in children]
        return False

    wait_until(all_ready, 120, interval=0.002, what="every writer to build its state")
    go.touch()
    return [(child, out) for child, _, out in started]


def _load(loc: str, where: Where) -> dict[str, Any]:
    like = writer_state(0, where.mib)
    dest = zeros_like(like)
    dcp.load(dest, storage_reader=CheckpointReader(loc, verify=True, **where.options))
    return dest


def _holds(got: dict[str, Any], seed: int, mib: int) -> bool:
    want = writer_state(seed, mib)
    return all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items())


def test_two_writers_one_location(where, forker, tmp_path):
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    rng = random.Random(f"{SEED}-{where.backend}")
    trials = fault_trials(12)
    outcomes: Counter = Counter()
    failures: list[str] = []
    for trial in range(trials):
        loc = where.make_uri(f"both{trial}")
        skews = {2 * trial + 1: rng.uniform(0, 0.04), 2 * trial + 2: rng.uniform(0, 0.04)}
        started = start_writers(forker, where, loc, tmp_path, f"both{trial}", skews)
        rcs = [c.wait(300) for c, _ in started]
        assert rcs == [0, 0], [c.log_tail() for c, _ in started]
        results = [json.loads(out.read_text()) for _, out in started]
        won = [r["seed"] for r in results if r["ok"]]
        lost = [r for r in results if not r["ok"]]
        if len(won) != 1 or [r["type"] for r in lost] != ["CheckpointExistsError"]:
            failures.append(f"trial {trial}: {results}")
            continue
        else:
            # Where the loser was stopped: before writing (a committed checkpoint was there), or
            # at its own commit (the other committed while both were writing).
            outcomes[
                "refused at its commit" if "while this save ran" in lost[0]["message"] else "refused before writing"
            ] += 1
        report = verify_checkpoint(loc, **where.options)
        if not report.ok:
            failures.append(
                f"trial {trial}: the committed checkpoint does not verify: {[p.message for p in report.problems]}"
            )
            continue
        got = _load(loc, where)
        if got["writer"] != won[0] or not _holds(got, won[0], where.mib):
            failures.append(
                f"trial {trial}: writer {won[0]} committed, the location holds writer {got['writer']}'s "
                f"step value (all values theirs: {_holds(got, got['writer'], where.mib)})"
            )
    record(
        "two writers, one location",
        where.backend,
        trials=trials,
        faults_injected=trials,
        detected_or_recovered=trials - len(failures),
        data_lost=len(failures),
        outcomes=dict(outcomes),
    )
    assert not failures, "\n".join(failures)


def test_commit_race_loser_gets_checkpoint_exists_error(tmp_path, monkeypatch):
    """Deterministic form of a race the two-writer trials hit now and then: the rival commits
    (and cleans up) between the moment this save wrote its temporary manifest and its link."""
    import os

    from goodput_ckpt import CheckpointExistsError, CheckpointWriter

    loc = str(tmp_path / "loc")
    real_link = os.link

    def rival_commits_first(src, dst):
        monkeypatch.setattr(os, "link", real_link)
        dcp.save(writer_state(1, 1), storage_writer=CheckpointWriter(loc))
        return real_link(src, dst)

    monkeypatch.setattr(os, "link", rival_commits_first)
    with pytest.raises(CheckpointException) as info:
        dcp.save(writer_state(2, 1), storage_writer=CheckpointWriter(loc))
    assert verify_checkpoint(loc).ok and _holds(_load(loc, Where("local", None, {}, 1, 0)), 1, 1)
    err = find_checkpoint_error(info.value)
    assert isinstance(err, CheckpointExistsError), repr(err)


def test_s3_commit_race_loser_whose_files_were_cleaned_up_gets_checkpoint_exists_error(seaweed, monkeypatch):
    """Deterministic form of an S3 race the two-writer trials hit now and then: the rival
    commits, and deletes this save's freshly stored data objects, just before this save commits.
    This save must end with CheckpointExistsError (its conditional PUT meets the rival's record),
    never a record that names deleted files. (Before issue 37's request cuts the moment was the
    size check after the upload; SeaweedFS confirms each part's CRC-32, so there is none now.)"""
    from goodput_ckpt import CheckpointExistsError, CheckpointWriter
    from goodput_ckpt.storage.s3 import S3Store

    where = Where("s3", seaweed.uri, seaweed.options(), mib=8, chunk_size=5 << 20)  # multipart
    loc = where.make_uri("rival")
    real_commit = S3Store.put_commit_record
    rival = []

    def rival_commits_first(self, name, data, *, replace):
        if not rival:
            rival.append(True)
            ours = [k for k in seaweed.keys("rival/") if k.endswith(".bin")]
            dcp.save(writer_state(1, 8), storage_writer=CheckpointWriter(loc, **where.options))
            # The rival removes the files its manifest does not name after its commit (when its
            # listing before the save saw them): done here so it always happens.
            for key in ours:
                seaweed.client().delete_object(Bucket=seaweed.bucket, Key=key)
        return real_commit(self, name, data, replace=replace)

    monkeypatch.setattr(S3Store, "put_commit_record", rival_commits_first)
    with pytest.raises(CheckpointException) as info:
        dcp.save(writer_state(2, 8), storage_writer=CheckpointWriter(loc, **where.options))
    monkeypatch.setattr(S3Store, "put_commit_record", real_commit)
    assert rival and isinstance(find_checkpoint_error(info.value), CheckpointExistsError), repr(info.value)
    assert verify_checkpoint(loc, **where.options).ok and _holds(_load(loc, where), 1, 8)


def test_reader_racing_a_writer(where, forker, tmp_path):
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    trials = fault_trials(6)
    looks: Counter = Counter()
    failures: list[str] = []
    for trial in range(trials):
        loc = where.make_uri(f"race{trial}")
        seed = 100 + trial
        [(child, out)] = start_writers(forker, where, loc, tmp_path, f"race{trial}", {seed: 0.0})
        seen: list[str] = []
        deadline = time.monotonic() + 300
        while True:
            assert time.monotonic() < deadline, f"trial {trial}: the writer ran for 300 s: {child.log_tail()}"
            done = child.exited()  # decided before the look: a look after the exit must see it all
            try:
                CheckpointReader(loc, **where.options).read_metadata()
            except CheckpointNotFoundError:
                seen.append("nothing")
            except IncompleteCheckpointError:
                seen.append("incomplete")
            else:
                try:
                    got = _load(loc, where)
                except (CheckpointException, Exception) as e:  # noqa: BLE001 - any failure is a finding
                    err = find_checkpoint_error(e) if isinstance(e, BaseException) else None
                    failures.append(f"trial {trial}: a committed checkpoint failed to load: {err or e}")
                    break
                if not _holds(got, seed, where.mib):
                    failures.append(f"trial {trial}: a look returned values that are not the writer's")
                seen.append("complete")
                break
            if done:
                break
        assert child.wait(300) == 0, child.log_tail()
        assert json.loads(out.read_text())["ok"]
        if seen[-1:] != ["complete"]:
            failures.append(f"trial {trial}: the reader never saw the committed checkpoint: {Counter(seen)}")
        looks.update(seen)
    # Trials: the races; faults injected: the looks at the location while (or just after) it was
    # written; detected or recovered: the looks that saw a consistent state.
    record(
        "reader racing a writer (looks)",
        where.backend,
        trials=trials,
        faults_injected=sum(looks.values()),
        detected_or_recovered=sum(looks.values()) - len(failures),
        data_lost=len(failures),
        looks=dict(looks),
    )
    assert not failures, "\n".join(failures)
    assert looks["incomplete"] + looks["nothing"] > 0, f"the reader never saw the save in progress: {looks}"
