"""Storage that runs out: a full disk (a small tmpfs) and the file-size limit (RLIMIT_FSIZE).

In both, a save that cannot be written must fail with a clear :class:`CheckpointError` (found
inside DCP's ``CheckpointException`` with ``find_checkpoint_error``) that says why and where,
must leave no manifest (the location is incomplete, never committed), and must not touch the
checkpoints saved before it. Under a :class:`CheckpointManager` with async saves the training
loop keeps going: the failure reaches ``on_error``, ``last_error`` and, once, ``wait()``, and
the next save that fits commits.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import warnings

import pytest
import torch.distributed.checkpoint as dcp
from _reliability import record
from crash_worker import TrialModel
from helpers.trees import assert_tree_equal, make_state, zeros_like
from torch.distributed.checkpoint.api import CheckpointException

from goodput_ckpt import (
    CheckpointError,
    CheckpointManager,
    CheckpointReader,
    CheckpointWriter,
    IncompleteCheckpointError,
)
from goodput_ckpt.errors import find_checkpoint_error
from goodput_ckpt.format.manifest import MANIFEST_NAME
from goodput_ckpt.tools import list_checkpoints, verify_checkpoint

MiB = 1 << 20


@pytest.fixture
def tmpfs(tmp_path):
    """A 24 MiB tmpfs mounted at a fresh directory (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = tmp_path / "tmpfs"
    path.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(path)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path, leave: int) -> None:
    """Write a filler file so that only ``leave`` bytes stay free on ``path``'s filesystem."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    with open(os.path.join(path, "filler"), "wb") as f:
        f.write(bytes(max(0, free - leave)))


def state(mib: float, seed: int) -> dict:
    return make_state(seed, numel=int(mib * MiB) // 4)


def load(path) -> dict:
    dest = zeros_like(make_state(numel=CheckpointReader(str(path)).read_metadata().state_dict_metadata["w"].size[0]))
    dcp.load(dest, storage_reader=CheckpointReader(str(path)))
    return dest


def failed_save(sd: dict, path) -> CheckpointError:
    with pytest.raises(CheckpointException) as info:
        dcp.save(sd, storage_writer=CheckpointWriter(str(path)))
    err = find_checkpoint_error(info.value)
    assert err is not None, f"no CheckpointError in {info.value!r}"
    return err


def assert_not_committed(path) -> None:
    assert not os.path.exists(os.path.join(path, MANIFEST_NAME))
    if os.path.isdir(path) and os.listdir(path):
        with pytest.raises(IncompleteCheckpointError):
            CheckpointReader(str(path)).read_metadata()


def test_disk_full_fails_cleanly_and_keeps_earlier_checkpoints(tmpfs):
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    earlier = {name: state(4, i) for i, name in enumerate(("a", "b"))}
    for name, sd in earlier.items():
        dcp.save(sd, storage_writer=CheckpointWriter(str(tmpfs / name)))
    before = {n: (tmpfs / n / f).read_bytes() for n in earlier for f in os.listdir(tmpfs / n)}
    cases = 0

    # Data writes: the disk fills up in the middle of a data file.
    fill(tmpfs, 3 * MiB)
    err = failed_save(state(6, 7), tmpfs / "c")
    assert "disk is full" in str(err) and str(tmpfs / "c") in str(err) and ".bin" in str(err), err
    assert_not_committed(tmpfs / "c")
    assert not [n for n in os.listdir(tmpfs / "c") if n.endswith(".bin")], "the failed save's data files stay"
    cases += 1

    # The commit: the data fits, the manifest does not (its page is the one missing).
    os.remove(tmpfs / "filler")
    probe = tmpfs / "probe"
    dcp.save(state(2, 8), storage_writer=CheckpointWriter(str(probe)))
    data_bytes = sum(os.path.getsize(probe / n) for n in os.listdir(probe) if n.endswith(".bin"))
    shutil.rmtree(probe)
    fill(tmpfs, -(-data_bytes // 4096) * 4096)
    err = failed_save(state(2, 8), tmpfs / "d")
    assert "disk is full" in str(err) and f"committing {tmpfs / 'd' / MANIFEST_NAME}" in str(err), err
    assert_not_committed(tmpfs / "d")
    assert not [n for n in os.listdir(tmpfs / "d") if n.startswith(".manifest")], "a temporary manifest stays"
    cases += 1

    # Earlier checkpoints: byte for byte as they were, and they load.
    assert {n: (tmpfs / n / f).read_bytes() for n in earlier for f in os.listdir(tmpfs / n)} == before
    for name, sd in earlier.items():
        assert verify_checkpoint(str(tmpfs / name)).ok
        got = load(tmpfs / name)
        assert_tree_equal(got, sd)
    # Space freed: the same locations take a save (the failed ones were never committed).
    os.remove(tmpfs / "filler")
    for name in ("c", "d"):
        dcp.save(state(1, 9), storage_writer=CheckpointWriter(str(tmpfs / name)))
        assert verify_checkpoint(str(tmpfs / name)).ok
    record(
        "disk full (tmpfs): data write, manifest commit",
        "local",
        trials=cases,
        faults_injected=cases,
        detected_or_recovered=cases,
        data_lost=0,
    )


def test_disk_full_under_the_manager_keeps_training_going(tmpfs):
    root = tmpfs / "run"
    calls: list[tuple[int, CheckpointError]] = []
    model = TrialModel(3 << 10)  # 3 MiB a step
    mgr = CheckpointManager(root, keep_last=3, on_error=lambda s, e: calls.append((s, e)), timeline=False)
    try:
        trained = []
        for step in range(1, 7):
            if step == 3:
                mgr.wait()  # step 2 is committed (no failure yet) ...
                fill(tmpfs, 1 * MiB)  # ... when something else fills the disk
            if step == 5:
                with pytest.raises(CheckpointError) as info:
                    mgr.wait()  # the loop looks: the first failure not yet raised
                mgr.wait()  # raised once
                os.remove(tmpfs / "filler")  # space is freed
            model.fill(step)
            mgr.save(step, model=model, extra={"step": step})  # never raises: async, not fail_fast
            trained.append(step)
        mgr.wait()  # steps 5 and 6 committed
    finally:
        mgr.close()
    assert trained == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in calls] == [3, 4], calls
    for _, e in calls:
        assert type(e) is CheckpointError and "disk is full" in str(e), e
    # wait() reports every failed step, newest first, with the count (issue 32: only the first before)
    assert str(info.value).startswith("2 background saves failed, newest first: step 4: "), info.value
    assert str(info.value).index("step_00000004") < str(info.value).index("step_00000003"), info.value
    assert "disk is full" in str(info.value) and type(info.value) is CheckpointError
    assert "step_00000004" in str(mgr.last_error)
    mgr = CheckpointManager(root, keep_last=3, timeline=False)
    try:
        assert mgr.steps() == [2, 5, 6]  # 1 retired by retention, 3 and 4 never committed
        rows = {r.step: r.status for r in list_checkpoints(str(root), verify=True).checkpoints}
        assert sorted(s for s, st in rows.items() if st == "complete") == [2, 5, 6], rows
        assert all(st == "incomplete" for s, st in rows.items() if s in (3, 4)), rows
        for s in (3, 4):
            assert_not_committed(root / f"step_0000000{s}")
        restored = TrialModel(3 << 10)
        assert mgr.restore(model=restored) == 6 and restored.holds(6)
        assert mgr.restore(2, model=restored) == 2 and restored.holds(2)
    finally:
        mgr.close()
    record(
        "disk full (tmpfs): CheckpointManager async saves",
        "local",
        trials=2,
        faults_injected=2,
        detected_or_recovered=2,
        data_lost=0,
    )


def test_file_size_limit(forker, tmp_path):
    out = tmp_path / "result.json"
    limit = 2 * MiB
    child = forker.run(
        "limit_worker:run",
        {
            "location": str(tmp_path / "direct"),
            "root": str(tmp_path / "run"),
            "out": str(out),
            "limit": limit,
            "small_kib": 512,
            "big_kib": 4096,
        },
        tmp_path / "worker.log",
    )
    assert child.wait(300) == 0, child.log_tail()
    r = json.loads(out.read_text())
    direct = r["direct"]
    assert direct is not None and direct["type"] == "CheckpointError", direct
    assert "file-size limit" in direct["message"] and str(tmp_path / "direct") in direct["message"]
    assert_not_committed(tmp_path / "direct")

    assert r["trained"] == [1, 2, 3, 4, 5]
    assert [s for s, _ in r["on_error"]] == [3], r["on_error"]
    for e in (r["on_error"][0][1], r["last_error"], r["wait"]):
        assert (
            e["type"] == "CheckpointError" and "file-size limit" in e["message"] and "step_00000003" in e["message"]
        ), e
    assert r["second_wait"] is None
    assert r["steps"] == [1, 2, 4, 5]
    assert_not_committed(tmp_path / "run" / "step_00000003")
    mgr = CheckpointManager(tmp_path / "run", timeline=False)
    try:
        for s in (1, 2, 4, 5):
            assert verify_checkpoint(mgr.step_uri(s)).ok
            model = TrialModel(512)
            assert mgr.restore(s, model=model) == s and model.holds(s)
    finally:
        mgr.close()
    record(
        "file-size limit (RLIMIT_FSIZE): dcp.save and CheckpointManager",
        "local",
        trials=2,
        faults_injected=2,
        detected_or_recovered=2,
        data_lost=0,
    )


def _fill_after_step_2(tmpfs, **opts) -> tuple[CheckpointManager, list[int]]:
    """Steps 1-6 of 3 MiB through a manager with ``keep_last=2``; after step 2 something else
    fills the disk up to 1 MiB of free space. Returns the manager (open) and the steps saved."""
    mgr = CheckpointManager(tmpfs / "run", keep_last=2, timeline=False, **opts)
    model = TrialModel(3 << 10)
    for step in range(1, 7):
        if step == 3:
            mgr.wait()
            fill(tmpfs, 1 * MiB)
        model.fill(step)
        mgr.save(step, model=model)
    return mgr, list(range(1, 7))


def test_a_full_disk_reports_every_failed_step_at_close(tmpfs):
    """By default nothing is deleted to make room: every save after the disk filled fails, and
    close() names all of them, newest first, with the count (before: only step 3)."""
    mgr, _ = _fill_after_step_2(tmpfs)
    with pytest.raises(CheckpointError) as info:
        mgr.close()
    msg = str(info.value)
    assert msg.startswith("4 background saves failed, newest first: step 6: "), msg
    assert [msg.index(f"step {s}: ") for s in (6, 5, 4, 3)] == sorted(msg.index(f"step {s}: ") for s in (6, 5, 4, 3))
    assert "disk is full" in msg
    with CheckpointManager(tmpfs / "run", timeline=False) as again:
        assert again.steps() == [1, 2]


def test_free_space_on_full_deletes_the_oldest_step_and_retries_once(tmpfs, caplog):
    """With free_space_on_full=True each save that finds the disk full deletes the oldest
    complete step beyond the newest one and is tried once more: training keeps a checkpoint of
    every step, within the room the disk has."""
    import logging

    with caplog.at_level(logging.WARNING, logger="goodput_ckpt"):
        mgr, _ = _fill_after_step_2(tmpfs, free_space_on_full=True)
        mgr.close()  # nothing failed
    assert mgr.last_error is None
    freed = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("goodput_ckpt") and "free_space_on_full" in r.getMessage()
    ]
    assert freed and all("is full; deleted step(s)" in m and "trying once more" in m for m in freed), freed
    with CheckpointManager(tmpfs / "run", timeline=False) as again:
        assert again.steps()[-1] == 6
        restored = TrialModel(3 << 10)
        assert again.restore(model=restored) == 6 and restored.holds(6)
