"""gc_paused (format/gc_pause.py): the cyclic collector is off while a commit record is built,
serialized, parsed or turned into DCP metadata, and comes back after, also on errors, nested,
across threads, and never when it was off before. (What it saves is measured in
benchmarks/bench_scale.py, not timed here.)"""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointWriter
from goodput_ckpt.dcp import commit_build
from goodput_ckpt.errors import CorruptCheckpointError
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
    monkeypatch.setattr(
        commit_build, "items_from_ranks", lambda *a, **k: (during.append(gc.isenabled()), items_from_ranks(*a, **k))[1]
    )
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
        during.append(("broadcast", gc.isenabled()))
        return broadcast(*args, **kwargs)

    def watched(name, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            during.append((name, gc.isenabled()))  # after: the pause is taken inside
            return out

        return call

    dumps, loads = manifest_share.pickle.dumps, manifest_share.pickle.loads
    manifest_share.pickle = type(
        "P",
        (),
        {
            "dumps": staticmethod(watched("dumps", dumps)),
            "loads": staticmethod(watched("loads", loads)),
            "HIGHEST_PROTOCOL": 5,
        },
    )
    dist.broadcast_object_list = spy
    got = manifest_share.load_shared(lambda: {"records": list(range(1000))})
    Path(out, f"rank{rank}.json").write_text(json.dumps([during, gc.isenabled(), got["records"][-1]]))


def test_the_shared_record_is_pickled_and_unpickled_paused(tmp_path):
    from helpers.dist import run_ranks

    run_ranks(_share, 2, str(tmp_path), report_dir=tmp_path / "report", timeout=300)
    import json

    # rank 0 pickled the record paused, rank 1 unpickled it paused; the collective itself (a
    # wait as long as rank 0's read) ran with the collector on, and it is on after
    assert json.loads((tmp_path / "rank0.json").read_text()) == [[["dumps", False], ["broadcast", True]], True, 999]
    assert json.loads((tmp_path / "rank1.json").read_text()) == [[["broadcast", True], ["loads", False]], True, 999]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork: POSIX only")
def test_a_child_forked_during_another_threads_pause_collects_again():
    inside, done = threading.Event(), threading.Event()

    def pausing() -> None:
        with gc_paused():
            inside.set()
            done.wait(10)

    t = threading.Thread(target=pausing)
    t.start()
    inside.wait(10)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanup
        try:
            with gc_paused():
                pass
            os.write(write, b"1" if gc.isenabled() else b"0")
        finally:
            os._exit(0)
    os.close(write)
    got = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert not gc.isenabled()  # the parent's pause still holds
    done.set()
    t.join(10)
    assert got == b"1" and gc.isenabled()
