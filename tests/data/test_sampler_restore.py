"""Issue 34's three bugs of the elastic data position, each in a real gloo job through
``CheckpointManager`` (sampler_restore_job.py): an epoch-end save restored on the same world
size and on a larger one, a pending tail smaller than the new world, and ``set_epoch`` after a
same-topology restore."""

from __future__ import annotations

import json
from collections import defaultdict

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


#: Each scenario is saved by ``save_world`` ranks and restored by each of ``load_worlds`` (its own
#: saved root for each, as if separate jobs); ``batch`` defaults to ``job.BATCH``.
SCENARIOS: dict[str, dict] = {
    "in-the-loop": dict(n=24, save_world=2, save_after=6, load_worlds=(2, 3), epochs=2),
    "after-the-loop": dict(n=24, save_world=2, save_after=None, load_worlds=(2, 3), epochs=2),
    "pending-tail": dict(n=7, save_world=3, save_after=None, load_worlds=(2,), epochs=2, batch=1),
    "set-epoch": dict(n=24, save_world=2, save_after=3, load_worlds=(2,), epochs=3, jump_to=2),
}


@pytest.fixture(scope="module")
def reads(tmp_path_factory) -> dict[tuple[str, int], list[dict]]:
    """(scenario, load world) -> what each restored rank read (``resume_and_read``'s record).

    Every save of one world size runs in one gloo job, and every restore of one world size in
    another (``job.each``): four process groups for the whole module instead of two per case.
    """
    base = tmp_path_factory.mktemp("sampler_restore")
    saves: dict[int, list[tuple]] = defaultdict(list)
    loads: dict[int, list[tuple]] = defaultdict(list)
    outs = {}
    for name, sc in SCENARIOS.items():
        batch = sc.get("batch", job.BATCH)
        for world in sc["load_worlds"]:
            root, out = str(base / f"{name}-{world}" / "root"), base / f"{name}-{world}" / "out"
            out.mkdir(parents=True)
            saves[sc["save_world"]].append((root, sc["n"], sc["save_after"], batch, {}))
            loads[world].append((root, sc["n"], sc["epochs"], batch, {}, str(out), sc.get("jump_to")))
            outs[name, world] = out
    for world, cases in sorted(saves.items()):
        run_ranks(job.each, world, job.train_and_save, cases, report_dir=base / f"save{world}")
    for world, cases in sorted(loads.items()):
        run_ranks(job.each, world, job.resume_and_read, cases, report_dir=base / f"load{world}")
    return {
        (name, world): [json.loads((out / f"read-rank{r}.json").read_text()) for r in range(world)]
        for (name, world), out in outs.items()
    }


@pytest.mark.parametrize("save_after", ["in-the-loop", "after-the-loop"])
@pytest.mark.parametrize("load_world", [2, 3])
def test_a_save_at_an_epochs_last_batch_goes_on_with_the_next_epoch(reads, load_world, save_after):
    """24 samples, 2 ranks of batch 2: 6 steps an epoch; saved after the 6th, inside the loop or
    once it ended. The restored job, on the same world size or a larger one, reads epoch 1 and
    nothing of epoch 0 again (before: the same-topology restore of a save made after the loop
    read all of epoch 0 a second time: the loader starts a fresh iterator)."""
    got = reads[save_after, load_world]
    read = [tuple(x) for r in got for x in r["read"]]
    assert not [x for x in read if x[0] == 0], "epoch 0 was read again"
    ids = [i for _, i in read]
    assert len(ids) == len(set(ids)) and set(ids) == _expected(24, load_world, 1)


def test_a_pending_tail_smaller_than_the_new_world_gives_empty_shares(reads):
    """7 samples on 3 ranks with batch 1 and ``drop_last``: 2 each, 1 left for the tail; saved at
    the epoch's end and restored on 2 ranks, whose share of that tail is empty (before: rank 1
    crashed in ``iter()``), then epoch 1 is read."""
    got = reads["pending-tail", 2]
    read = [tuple(x) for r in got for x in r["read"]]
    assert not [x for x in read if x[0] == 0]
    assert {i for _, i in read} == _expected(7, 2, 1)


def test_set_epoch_after_a_same_topology_restore_starts_that_epoch(reads):
    """Saved in the middle of epoch 0; the restored job calls ``set_epoch(2)`` and reads epoch 2
    whole, as the docs say and the elastic path does (before: the loader applied the saved
    position and ``sampler.epoch`` went back to 0)."""
    got = reads["set-epoch", 2]
    read = [tuple(x) for r in got for x in r["read"]]
    assert {e for e, _ in read} == {2}
    assert sorted(i for _, i in read) == sorted(_expected(24, 2, 2))


def test_rank_share_of_fewer_pending_than_ranks():
    for rank in range(4):
        assert rank_share(3, 4, rank, drop_last=True).tolist() == []
        assert rank_share(0, 4, rank, drop_last=False).tolist() == []
    assert torch.cat([rank_share(3, 4, r, drop_last=False) for r in range(4)]).tolist() == [0, 1, 2, 0]
