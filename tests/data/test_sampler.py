"""ElasticSampler: a drop-in for DistributedSampler whose saved position is global.

Ranks are simulated in one process (one sampler and one StatefulDataLoader per rank, with
``num_replicas``/``rank`` given): the position arithmetic does not depend on a process group.
The multi-process job with SIGKILLs is tests/data/test_elastic_resume.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers.datasets import Ids
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from goodput_ckpt.data import ElasticSampler
from goodput_ckpt.data.global_position import MAX_TAKEN
from goodput_ckpt.data.position import MAX_SEGMENTS
from goodput_ckpt.errors import CheckpointError, TopologyChangeError


def _loader(n, ws, rank, *, batch, workers, seed=0, drop_last=True):
    ds = Ids(n)
    s = ElasticSampler(ds, seed=seed, drop_last=drop_last, num_replicas=ws, rank=rank)
    return StatefulDataLoader(ds, batch_size=batch, sampler=s, num_workers=workers), s


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
def test_same_order_as_distributed_sampler(drop_last, shuffle):
    ds = Ids(23)
    for epoch in (0, 3):
        for rank in range(4):
            want = DistributedSampler(ds, num_replicas=4, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
            got = ElasticSampler(ds, shuffle=shuffle, seed=7, drop_last=drop_last, num_replicas=4, rank=rank)
            want.set_epoch(epoch)
            got.set_epoch(epoch)
            assert list(got) == list(want) and len(got) == len(want)


@pytest.mark.parametrize("workers", [0, 2])
def test_saved_position_is_what_was_yielded_not_prefetched(workers):
    """With workers, indices of several batches are drawn ahead; the position counts only the
    batches the loop received, and a same-topology restore continues exactly after them."""
    loader, _ = _loader(40, 2, 1, batch=3, workers=workers)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(4)]
    state = loader.state_dict()
    found, since = ElasticSampler.find_state(state)
    assert found["consumed"] + since * 3 == 12
    rest = [b.tolist() for b in it]

    fresh, sampler = _loader(40, 2, 1, batch=3, workers=workers)
    fresh.load_state_dict(state)
    sampler.adopt_saved_epoch(state)
    assert [b.tolist() for b in fresh] == rest
    assert sorted(sum(seen + rest, [])) == sorted(list(ElasticSampler(Ids(40), num_replicas=2, rank=1)))


def _run(loaders, steps):
    """Every rank takes ``steps`` batches; returns the ids and the loaders' states."""
    ids, its = [], [iter(ld) for ld, _ in loaders]
    for _ in range(steps):
        for it in its:
            ids += next(it).tolist()
    return ids, [ld.state_dict() for ld, _ in loaders]


@pytest.mark.parametrize("workers", [0, 2])
def test_restarts_at_other_world_sizes_lose_and_repeat_nothing(workers):
    n, batch = 101, 2
    seen: list[int] = []
    states = None
    for ws, steps in ((4, 3), (3, 4), (2, 1), (4, 2), (3, 100)):
        loaders = [_loader(n, ws, r, batch=batch + (ws % 2), workers=workers if ws % 2 else 0) for r in range(ws)]
        if states is not None:
            for _, s in loaders:
                note = s.elastic_resume(states, batch_size=None)
                assert "pending" in note and s.epoch == 0
        steps = min(steps, min(len(ld) for ld, _ in loaders))
        ids, states = _run(loaders, steps)
        seen += ids
    assert len(seen) == len(set(seen)), "no sample twice"
    assert n - len(seen) < 3 * 3, "at most one partial global batch missing"


def test_unequal_counts_and_many_restarts_stay_exact():
    """Ranks that stopped at different counts, over more restarts than version 1 kept segments
    for: the record's exceptions stay few (each restart's uneven counts add at most a rank's)."""
    n = 200
    seen: list[int] = []
    states = None
    for k in range(MAX_SEGMENTS + 4):
        ws = 2 + k % 3
        samplers = [ElasticSampler(Ids(n), num_replicas=ws, rank=r, seed=3) for r in range(ws)]
        if states is not None:
            for s in samplers:
                s.elastic_resume(states, batch_size=None)
        its = [iter(s) for s in samplers]
        states = []
        for r, it in enumerate(its):
            for _ in range(1 + r % 2):  # rank-dependent counts
                seen.append(next(it))
            states.append({"_sampler_iter_state": it.state_dict()})
    assert len(seen) == len(set(seen))
    assert len(samplers[0]._next_position().taken) <= MAX_TAKEN, "a bounded record"
    last = ElasticSampler(Ids(n), num_replicas=1, rank=0, seed=3)
    last.elastic_resume(states, batch_size=None)
    left = list(last)
    assert sorted(left + seen) == list(range(n)), "the rest is exactly what was not consumed"


def test_epoch_end_and_next_epoch():
    loaders = [_loader(10, 2, r, batch=5, workers=0) for r in range(2)]
    _, states = _run(loaders, 1)  # the whole epoch (5 per rank)
    (ld, s) = _loader(10, 3, 0, batch=5, workers=0)
    s.elastic_resume(states, batch_size=None)
    assert list(ld) == [] and s.epoch == 0
    s.set_epoch(1)
    assert len(list(s)) == 3


def test_set_epoch_keeps_a_restored_position_of_the_same_epoch():
    loaders = [_loader(30, 2, r, batch=2, workers=0) for r in range(2)]
    for _, s in loaders:
        s.set_epoch(5)
    _, states = _run(loaders, 2)
    s = ElasticSampler(Ids(30), num_replicas=1, rank=0)
    s.elastic_resume(states, batch_size=None)
    assert s.epoch == 5
    s.set_epoch(5)
    assert len(s) == 30 - 8
    assert len(list(s)) == 22
    assert len(list(s)) == 30, "once the rest is read, the epoch starts anew (as DistributedSampler)"
    s.elastic_resume(states, batch_size=None)
    s.set_epoch(6)
    assert len(list(s)) == 30


def test_another_sampler_is_refused():
    loaders = [_loader(30, 2, r, batch=2, workers=0) for r in range(2)]
    _, states = _run(loaders, 1)
    for kw in ({"seed": 1}, {"drop_last": False}):
        s = ElasticSampler(Ids(30), num_replicas=3, rank=0, **kw)
        with pytest.raises(CheckpointError, match="differs from the saved one"):
            s.elastic_resume(states, batch_size=None)
    with pytest.raises(CheckpointError, match="differs"):
        ElasticSampler(Ids(31), num_replicas=3, rank=0).elastic_resume(states, batch_size=None)


def test_snapshots_every_few_steps_still_count_what_was_yielded():
    """With snapshot_every_n_steps > 1 the loader returns an older snapshot plus the steps since;
    the position adds those steps' batches."""
    ds = Ids(40)
    loader = StatefulDataLoader(
        ds, batch_size=3, sampler=ElasticSampler(ds, num_replicas=1, rank=0), num_workers=2, snapshot_every_n_steps=3
    )
    it = iter(loader)
    seen = [i for _ in range(4) for i in next(it).tolist()]
    states = [loader.state_dict()]
    found, since = ElasticSampler.find_state(states[0])
    assert since > 0 and found["consumed"] + since * 3 == 12
    s = ElasticSampler(ds, num_replicas=2, rank=0)
    s.elastic_resume(states, batch_size=3)
    t = ElasticSampler(ds, num_replicas=2, rank=1)
    t.elastic_resume(states, batch_size=3)
    assert sorted(seen + list(s) + list(t)) == list(range(40))


def test_checkpoint_ranks_sharing_a_sampler_rank():
    """Tensor parallelism: checkpoint ranks 0-1 are sampler rank 0, 2-3 sampler rank 1. Their
    states agree and count once; a missing sampler rank or a disagreeing replica is refused."""
    loaders = [_loader(30, 2, r, batch=2, workers=0) for r in range(2)]
    _, states = _run(loaders, 2)
    tp = [states[0], states[0], states[1], states[1]]
    s = ElasticSampler(Ids(30), num_replicas=1, rank=0)
    s.elastic_resume(tp, batch_size=None)
    assert len(list(s)) == 30 - 8
    with pytest.raises(TopologyChangeError, match="not all of"):
        s.elastic_resume([states[0], states[0]], batch_size=None)
    _, later = _run(loaders, 1)
    with pytest.raises(TopologyChangeError, match="not in step"):
        s.elastic_resume([states[0], later[0], states[1]], batch_size=None)


def test_a_hostile_position_is_refused_before_it_drives_work():
    """A saved position is read from a checkpoint: its segment count and bitmap are bounded
    before they drive a loop or an index (a state with 10^5 segments, or a bitmap shorter than
    the epoch, was looped over or failed with an IndexError)."""

    from goodput_ckpt.data.position import MAX_SEGMENTS, EpochPosition

    with pytest.raises(ValueError, match="segments"):
        EpochPosition.from_state({"epoch": 0, "segments": [[1, [0]]] * (MAX_SEGMENTS + 1), "done": None})
    short = EpochPosition.from_state({"epoch": 0, "segments": [], "done": torch.zeros(1, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="bitmap covers 8 samples"):
        short.pending(torch.arange(100))
