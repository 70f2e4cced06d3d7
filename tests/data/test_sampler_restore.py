"""Issue 34's three bugs of the elastic data position, each in a real gloo job through
``CheckpointManager`` (sampler_restore_job.py): an epoch-end save restored on the same world
size and on a larger one, a pending tail smaller than the new world, and ``set_epoch`` after a
same-topology restore."""

from __future__ import annotations

import json

import pytest
import sampler_restore_job as job
import torch
from helpers.dist import run_ranks

from goodput_ckpt.data import ElasticSampler
from goodput_ckpt.data.position import rank_share

pytestmark = pytest.mark.multiproc


def _expected(n: int, world: int, epoch: int, **opts) -> set[int]:
    """The samples an uninterrupted job reads in ``epoch`` (every rank's share)."""
    out = set()
    for r in range(world):
        s = ElasticSampler(job.Ids(n), shuffle=True, seed=5, num_replicas=world, rank=r, **opts)
        s.set_epoch(epoch)
        out.update(iter(s))
    return out


def _run(tmp_path, *, n, save_world, save_after, load_world, epochs, batch=job.BATCH, opts=None, jump_to=None):
    opts = opts or {}
    root, out = str(tmp_path / "root"), tmp_path / "out"
    out.mkdir()
    run_ranks(job.train_and_save, save_world, root, n, save_after, batch, opts, report_dir=tmp_path / "r1")
    run_ranks(
        job.resume_and_read, load_world, root, n, epochs, batch, opts, str(out), jump_to, report_dir=tmp_path / "r2"
    )
    return [json.loads((out / f"read-rank{r}.json").read_text()) for r in range(load_world)]


@pytest.mark.parametrize("save_after", [6, None], ids=["in-the-loop", "after-the-loop"])
@pytest.mark.parametrize("load_world", [2, 3])
def test_a_save_at_an_epochs_last_batch_goes_on_with_the_next_epoch(tmp_path, load_world, save_after):
    """24 samples, 2 ranks of batch 2: 6 steps an epoch; saved after the 6th, inside the loop or
    once it ended. The restored job, on the same world size or a larger one, reads epoch 1 and
    nothing of epoch 0 again (before: the same-topology restore of a save made after the loop
    read all of epoch 0 a second time: the loader starts a fresh iterator)."""
    got = _run(tmp_path, n=24, save_world=2, save_after=save_after, load_world=load_world, epochs=2)
    read = [tuple(x) for r in got for x in r["read"]]
    assert not [x for x in read if x[0] == 0], "epoch 0 was read again"
    ids = [i for _, i in read]
    assert len(ids) == len(set(ids)) and set(ids) == _expected(24, load_world, 1)


def test_a_pending_tail_smaller_than_the_new_world_gives_empty_shares(tmp_path):
    """7 samples on 3 ranks with batch 1 and ``drop_last``: 2 each, 1 left for the tail; saved at
    the epoch's end and restored on 2 ranks, whose share of that tail is empty (before: rank 1
    crashed in ``iter()``), then epoch 1 is read."""
    got = _run(tmp_path, n=7, save_world=3, save_after=None, load_world=2, epochs=2, batch=1)
    read = [tuple(x) for r in got for x in r["read"]]
    assert not [x for x in read if x[0] == 0]
    assert {i for _, i in read} == _expected(7, 2, 1)


def test_set_epoch_after_a_same_topology_restore_starts_that_epoch(tmp_path):
    """Saved in the middle of epoch 0; the restored job calls ``set_epoch(2)`` and reads epoch 2
    whole, as the docs say and the elastic path does (before: the loader applied the saved
    position and ``sampler.epoch`` went back to 0)."""
    got = _run(tmp_path, n=24, save_world=2, save_after=3, load_world=2, epochs=3, jump_to=2)
    read = [tuple(x) for r in got for x in r["read"]]
    assert {e for e, _ in read} == {2}
    assert sorted(i for _, i in read) == sorted(_expected(24, 2, 2))


def test_rank_share_of_fewer_pending_than_ranks():
    for rank in range(4):
        assert rank_share(3, 4, rank, drop_last=True).tolist() == []
        assert rank_share(0, 4, rank, drop_last=False).tolist() == []
    assert torch.cat([rank_share(3, 4, r, drop_last=False) for r in range(4)]).tolist() == [0, 1, 2, 0]
