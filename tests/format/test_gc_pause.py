"""gc_paused (format/gc_pause.py): the cyclic collector is off while a commit record is built,
serialized, parsed or turned into DCP metadata, and comes back after, also on errors, nested,
across threads, and never when it was off before. (What it saves is measured in
benchmarks/bench_scale.py, not timed here.)"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointWriter
from goodput_ckpt.errors import CorruptCheckpointError
from goodput_ckpt.dcp import commit_build
from goodput_ckpt.format import parse as parse_module
from goodput_ckpt.format import schema
from goodput_ckpt.format.dcp_metadata import to_dcp_metadata
from goodput_ckpt.format.gc_pause import gc_paused
from goodput_ckpt.format.manifest import MANIFEST_NAME, parse_manifest


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_off_inside_on_after_also_when_the_body_raises():
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_threads_overlapping_pauses_restore_it_once_the_last_ends():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def first() -> None:
        with gc_paused():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second() -> None:
        first_in.wait(10)
        with gc_paused():
            second_in.set()
            first_out.wait(10)
            seen.append(gc.isenabled())  # the first thread's pause ended, this one holds
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == [False] and gc.isenabled()


def test_the_record_paths_run_paused(tmp_path, monkeypatch):
    dcp.save({"w": torch.arange(6.0)}, storage_writer=CheckpointWriter(tmp_path), no_dist=True)
    data = (tmp_path / MANIFEST_NAME).read_bytes()
    during: list[bool] = []
    check_spans = parse_module.check_spans

    def spy(*args, **kwargs):
        during.append(gc.isenabled())
        return check_spans(*args, **kwargs)

    monkeypatch.setattr(parse_module, "check_spans", spy)
    manifest = parse_manifest(data)
    assert during == [False] and gc.isenabled()
    with pytest.raises(CorruptCheckpointError):
        parse_manifest(data[:-20])
    assert gc.isenabled()
    seal = schema.seal_manifest
    monkeypatch.setattr(schema, "seal_manifest", lambda *a, **k: (during.append(gc.isenabled()), seal(*a, **k))[1])
    assert manifest.to_json() == data and gc.isenabled()
    items_from_ranks = commit_build.items_from_ranks
    monkeypatch.setattr(commit_build, "items_from_ranks", lambda *a, **k: (during.append(gc.isenabled()), items_from_ranks(*a, **k))[1])
    commit_build.forget_layouts()  # so that the save builds its entries afresh
    dcp.save({"w": torch.arange(6.0)}, storage_writer=CheckpointWriter(tmp_path / "again"), no_dist=True)
    assert during == [False] * 5 and gc.isenabled()  # parse, serialize; the save's build, serialize, self-check
    to_dcp_metadata(manifest)
    assert gc.isenabled()


def _share(rank: int, world: int, out: str) -> None:
    """load_shared on real gloo ranks, the broadcast wrapped to see the collector during it."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from goodput_ckpt.dcp import manifest_share

    broadcast = dist.broadcast_object_list
    during: list[bool] = []

    def spy(*args, **kwargs):
        during.append(gc.isenabled())
        return broadcast(*args, **kwargs)

    dist.broadcast_object_list = spy
    got = manifest_share.load_shared(lambda: {"records": list(range(1000))})
    Path(out, f"rank{rank}.json").write_text(json.dumps([during, gc.isenabled(), got["records"][-1]]))


def test_the_shared_record_crosses_the_group_paused(tmp_path):
    from helpers.dist import run_ranks

    run_ranks(_share, 2, str(tmp_path), report_dir=tmp_path / "report", timeout=300)
    import json

    for rank in (0, 1):  # the pickling (rank 0) and unpickling (rank 1) ran paused; on again after
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [[False], True, 999]
