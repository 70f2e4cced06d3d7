"""The manager's per-save timeline: records, where they go, and what they add up to."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from goodput_ckpt import CheckpointError, CheckpointManager
from goodput_ckpt.manager.timeline import (
    TIMELINE_NAME,
    RestoreRecord,
    SaveRecord,
    read_timeline,
    summarize_timeline,
    tensor_nbytes,
)

SAVE_FIELDS = {
    "event",
    "step",
    "rank",
    "world_size",
    "time",
    "async",
    "wait_s",
    "stage_s",
    "guard_s",
    "stall_s",
    "write_s",
    "durable_s",
    "bytes",
    "gbps",
    "ok",
    "error",
}


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


# fp32 weight + bias, plus AdamW's exp_avg and exp_avg_sq of both, plus its 'step' tensors
STATE_BYTES = 3 * (64 * 32 + 32) * 4 + 2 * 4


@pytest.mark.parametrize("async_save", [True, False])
def test_saves_and_restores_are_recorded_in_a_file_under_a_local_root(tmp_path, async_save):
    model, opt = _model()
    with CheckpointManager(tmp_path, async_save=async_save, keep_last=2, save_rng=False) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, model=model, optimizer=opt)
        assert mgr.restore(model=model, optimizer=opt) == 30
        assert mgr.timeline_path == str(tmp_path / TIMELINE_NAME)
        in_memory = mgr.timeline
    records = read_timeline(tmp_path / TIMELINE_NAME)
    assert records == in_memory
    saves = [r for r in records if r["event"] == "save"]
    assert [r["step"] for r in saves] == [10, 20, 30]
    for r in saves:
        assert set(r) == SAVE_FIELDS
        assert r["ok"] and r["error"] is None and r["async"] is async_save
        assert (r["rank"], r["world_size"]) == (0, 1)
        assert r["bytes"] == STATE_BYTES
        assert 0 <= r["wait_s"] <= r["stall_s"] and r["write_s"] > 0 and r["durable_s"] >= r["write_s"]
        assert r["gbps"] == pytest.approx(r["bytes"] / r["write_s"] / 1e9)
        if async_save:
            assert r["stall_s"] == pytest.approx(r["wait_s"] + r["stage_s"] + r["guard_s"])
        else:
            assert r["stage_s"] == 0 and r["stall_s"] >= r["write_s"]
    (restore,) = [r for r in records if r["event"] == "restore"]
    assert restore["step"] == 30 and restore["ok"] and restore["seconds"] > 0 and restore["bytes"] == STATE_BYTES
    # Retention deleted step 10 but never touches the timeline.
    assert mgr.steps() == [20, 30] and (tmp_path / TIMELINE_NAME).exists()

    summary = summarize_timeline(records)
    assert summary["saves"] == 3 and summary["failed_saves"] == 0 and summary["restores"] == 1
    assert summary["stall_s"]["count"] == 3 and summary["stall_s"]["max"] == max(r["stall_s"] for r in saves)
    assert summary["bytes_per_save"]["mean"] == STATE_BYTES


def test_a_failed_save_is_recorded_as_failed(tmp_path):
    model, opt = _model()
    seen = []
    mgr = CheckpointManager(tmp_path, timeline=seen.append, overwrite=False)
    mgr.save(5, model=model, optimizer=opt)
    mgr.wait()
    with CheckpointManager(tmp_path, timeline=False, async_save=False) as other:
        other.save(6, model=model, optimizer=opt)  # another process, after this manager listed the steps
    mgr.save(6, model=model, optimizer=opt)  # so refused only in the background, at the commit
    with pytest.raises(CheckpointError):
        mgr.wait()
    mgr.close()
    assert [(r["step"], r["ok"]) for r in seen] == [(5, True), (6, False)]
    assert "already holds a committed checkpoint" in seen[1]["error"] and seen[1]["gbps"] is None
    assert not (tmp_path / TIMELINE_NAME).exists()  # a callable replaces the default file
    assert summarize_timeline(seen)["failed_saves"] == 1


def test_timeline_targets(tmp_path):
    model, opt = _model()
    elsewhere = tmp_path / "logs" / "t.jsonl"
    with CheckpointManager(tmp_path / "a", timeline=elsewhere, async_save=False) as mgr:
        mgr.save(1, model=model, optimizer=opt)
    assert [r["step"] for r in read_timeline(elsewhere)] == [1]
    with CheckpointManager(tmp_path / "b", timeline=False, async_save=False) as mgr:
        mgr.save(1, model=model, optimizer=opt)
        assert mgr.timeline_path is None and len(mgr.timeline) == 1
    assert not (tmp_path / "b" / TIMELINE_NAME).exists()
    with pytest.raises(TypeError, match="timeline"):
        CheckpointManager(tmp_path / "c", timeline=3)


def test_a_broken_callback_or_unwritable_file_never_fails_a_save(tmp_path, caplog):
    model, opt = _model()

    def broken(record):
        raise RuntimeError("callback bug")

    with CheckpointManager(tmp_path / "a", timeline=broken, async_save=False) as mgr:
        mgr.save(1, model=model, optimizer=opt)
        assert mgr.steps() == [1]
    assert "timeline callback raised" in caplog.text
    (tmp_path / "dir").mkdir()
    with CheckpointManager(tmp_path / "b", timeline=tmp_path / "dir", async_save=False) as mgr:
        mgr.save(1, model=model, optimizer=opt)  # the "file" is a directory: cannot append
        assert mgr.steps() == [1]
    assert "could not append to the timeline" in caplog.text


def test_a_save_record_through_its_phases():
    """The typed record's JSON names the documented fields; staging, the optimizer steps' wait
    and the write add up as the timeline's docstring says."""
    r = SaveRecord(step=7, rank=1, world_size=2, time=1.5, is_async=True, wait_s=0.25, bytes=4000)
    r.staged(stage_s=0.5, stall_s=0.75)
    r.guarded(0.125)
    r.written(2.0)
    r.finish(time.perf_counter(), None)
    out = r.to_json()
    assert set(out) == SAVE_FIELDS and out["event"] == "save" and out["async"] is True
    assert out["stall_s"] == 0.875 and out["guard_s"] == 0.125 and out["write_s"] == 2.0
    assert out["gbps"] == 4000 / 2.0 / 1e9 and out["ok"] and out["error"] is None
    failed = SaveRecord(step=8, rank=0, world_size=1, time=2.0, is_async=False, wait_s=0.0, bytes=10)
    failed.finish(time.perf_counter(), "disk full", stall_from=time.perf_counter())
    out = failed.to_json()
    assert not out["ok"] and out["error"] == "disk full" and out["gbps"] is None and out["stage_s"] == 0.0
    assert out["write_s"] is not None and out["write_s"] >= 0  # set at the end when never written
    restore = RestoreRecord(step=8, rank=0, world_size=1, time=3.0, seconds=0.5, bytes=10).to_json()
    assert restore == {
        "event": "restore",
        "step": 8,
        "rank": 0,
        "world_size": 1,
        "time": 3.0,
        "seconds": 0.5,
        "bytes": 10,
        "ok": True,
        "error": None,
    }


def test_read_timeline_skips_a_torn_last_line_but_not_a_bad_middle_one(tmp_path):
    good = json.dumps({"event": "save", "step": 1})
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n" + '{"event": "sa')
    assert read_timeline(path) == [{"event": "save", "step": 1}]
    path.write_text('{"event": "sa\n' + good + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:1"):
        read_timeline(path)
    path.write_text("[1, 2]\n" + good + "\n")
    with pytest.raises(ValueError, match="not a JSON object"):
        read_timeline(path)


def test_summary_takes_the_slowest_rank_per_step():
    recs = [
        {"event": "save", "step": 1, "rank": r, "stall_s": s, "write_s": 1.0, "bytes": 10, "ok": True}
        for r, s in ((0, 0.1), (1, 0.3))
    ] + [
        {"event": "restore", "step": 1, "rank": r, "time": 100.0, "seconds": t, "ok": True}
        for r, t in ((0, 2.0), (1, 3.0))
    ]
    summary = summarize_timeline(recs)
    assert summary["stall_s"]["max"] == 0.3 and summary["stall_s"]["count"] == 1
    assert summary["bytes_per_save"]["total"] == 20
    assert summary["restore_s"]["median"] == 3.0 and summary["restores"] == 1


def test_tensor_nbytes_counts_nested_tensors_only():
    state = {"a": torch.zeros(3, dtype=torch.float64), "b": [torch.zeros(2, dtype=torch.int8), 5], "c": "x"}
    assert tensor_nbytes(state) == 3 * 8 + 2


def test_with_local_staging_a_save_is_done_once_it_is_durable_on_the_volume(tmp_path):
    """``stage_dir`` on a volume: the background save lands on local disk, then uploads; the
    manager waits for the upload before retention and records when it was durable."""
    model, opt = _model()
    stage = tmp_path / "stage"
    with CheckpointManager(tmp_path / "vol", volume=True, stage_dir=stage, keep_last=2) as mgr:
        for step in range(4):
            mgr.save(step, model=model, optimizer=opt)
        mgr.wait()
        assert mgr.steps() == [2, 3]  # every committed step is on the volume once wait returns
        saves = [r for r in mgr.timeline if r["event"] == "save"]
        assert all(r["ok"] and r["durable_s"] >= r["write_s"] for r in saves)
        assert mgr.restore(model=model, optimizer=opt) == 3
    assert not any(stage.rglob("*.bin"))  # the staged copies were removed after the upload
