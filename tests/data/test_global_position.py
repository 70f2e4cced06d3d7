"""The version-2 position (``GlobalPosition``): one fixed-size record per job, one global order.

Ranks are simulated in one process through the sampler API. Uninterrupted equality with
``DistributedSampler`` is tests/data/test_sampler.py::test_same_order_as_distributed_sampler.
"""

from __future__ import annotations

import io
import pickle
import random

import pytest
import torch
from helpers.datasets import Ids

from goodput_ckpt.data import ElasticSampler
from goodput_ckpt.data.global_position import MAX_RECORD_BYTES, MAX_TAKEN, GlobalPosition, OutOfStepError
from goodput_ckpt.data.position import epoch_order
from goodput_ckpt.errors import TopologyChangeError


def _states(samplers, counts):
    """Each simulated rank's loader-like state after it drew ``counts[r]`` samples."""
    out = []
    for s, c in zip(samplers, counts):
        it = iter(s)
        for _ in range(c):
            next(it)
        out.append({"_sampler_iter_state": it.state_dict()})
    return out


def _record_bytes(state: dict) -> int:
    return len(pickle.dumps(state["_sampler_iter_state"]["position"], protocol=2))


def test_after_a_restart_rank_r_continues_with_the_permutation_from_p_plus_r_by_the_new_world():
    n, seed = 97, 4
    perm = epoch_order(n, seed=seed, epoch=0, shuffle=True).tolist()
    old = [ElasticSampler(Ids(n), seed=seed, num_replicas=4, rank=r) for r in range(4)]
    states = _states(old, [5] * 4)  # p = 20
    for w in (1, 3, 7):
        for r in range(w):
            s = ElasticSampler(Ids(n), seed=seed, num_replicas=w, rank=r)
            s.elastic_resume(states, batch_size=None)
            per = (n - 20) // w
            assert list(s) == perm[20 + r :: w][:per]


@pytest.mark.parametrize("drop_last", [True, False])
def test_with_the_same_global_batch_the_global_batches_are_the_uninterrupted_runs(drop_last):
    """World sizes 4 -> 3 -> 2 -> 6 -> 4 with batches 3, 4, 6, 2, 3 (12 a step), a restart after a
    few steps each: step k's samples, over all ranks, are the uninterrupted run's step k."""
    n, seed, g = 120, 9, 12
    perm = epoch_order(n, seed=seed, epoch=0, shuffle=True).tolist()
    want = [set(perm[k * g : (k + 1) * g]) for k in range(n // g)]
    got, states = [], None
    for w, steps in ((4, 2), (3, 3), (2, 1), (6, 2), (4, 2)):
        b = g // w
        ss = [ElasticSampler(Ids(n), seed=seed, drop_last=drop_last, num_replicas=w, rank=r) for r in range(w)]
        for s in ss if states else ():
            s.elastic_resume(states, batch_size=b)
        its = [iter(s) for s in ss]
        for _ in range(steps):
            got.append({next(it) for it in its for _ in range(b)})
        states = [{"_sampler_iter_state": it.state_dict()} for it in its]
    assert got == want[: len(got)]


def test_state_after_40_restarts_at_1024_simulated_ranks_is_one_record_under_4_kb():
    """Acceptance (issue 34): 40 restarts, world sizes up to 1,024, 10 M samples; every rank's
    record is the same and at most 4 KB, whatever the history (a v1 position held a segment per
    restart, then a 1.25 MB bitmap, in every rank's row)."""
    n, rng = 10_000_000, random.Random(34)
    pos = GlobalPosition(0)
    sizes = []
    for k in range(40):
        w = 1024 if k % 2 == 0 else rng.randint(1, 1024)
        counts = [rng.randint(3, 5)] * w
        if k % 5 == 4:  # now and then the ranks were not in step: a few exceptions
            counts[rng.randrange(w)] += 2
        pos = pos.advanced(w, counts, n)
        sizes.append(len(pickle.dumps(pos.to_state(), protocol=2)))
    assert max(sizes) <= MAX_RECORD_BYTES == 4096
    # ... through the sampler API: the states of 1,024 simulated ranks after the last restart
    ss = [ElasticSampler(Ids(n), seed=1, num_replicas=1024, rank=r) for r in (0, 511, 1023)]
    fresh = {"_sampler_iter_state": {**iter(ss[0]).state_dict(), "position": pos.to_state()}}
    states = [{"_sampler_iter_state": {**fresh["_sampler_iter_state"], "rank": r, "consumed": 3}} for r in range(1024)]
    for s in ss:
        s.elastic_resume(states, batch_size=1)
    saved = [{"_sampler_iter_state": iter(s).state_dict()} for s in ss]
    assert len({repr(st["_sampler_iter_state"]["position"]) for st in saved}) == 1, "the same record on every rank"
    assert _record_bytes(saved[0]) <= 4096
    # what else a rank's entry holds of the sampler: its rank, world size, count and identity
    assert all(len(pickle.dumps(st["_sampler_iter_state"], protocol=2)) - _record_bytes(st) <= 256 for st in saved)


def test_the_largest_record_fits_4_kb():
    n = (1 << 62) - 1
    pos = GlobalPosition(1 << 62, n - MAX_TAKEN - 2, tuple(range(n - MAX_TAKEN, n)))
    buf = io.BytesIO()
    torch.save(pos.to_state(), buf)
    assert len(pickle.dumps(pos.to_state(), protocol=2)) <= MAX_RECORD_BYTES
    assert GlobalPosition.from_state(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), n) == pos


def test_uneven_counts_are_exceptions_and_read_nothing_twice():
    n = 50
    old = [ElasticSampler(Ids(n), seed=2, num_replicas=3, rank=r) for r in range(3)]
    states = _states(old, [4, 2, 3])
    seen = [i for st, s in zip(states, old) for i in list(s)[: st["_sampler_iter_state"]["consumed"]]]
    new = [ElasticSampler(Ids(n), seed=2, num_replicas=2, rank=r) for r in range(2)]
    for s in new:
        s.elastic_resume(states, batch_size=None)
    assert new[0]._pending.taken == new[1]._pending.taken != ()
    rest = [i for s in new for i in s]
    assert not set(seen) & set(rest)
    assert len(seen) + len(rest) >= n - 1  # the drop_last tail of 2 ranks: at most one sample


def test_ranks_too_far_out_of_step_are_refused_not_recorded():
    n = 10_000
    old = [ElasticSampler(Ids(n), seed=2, num_replicas=2, rank=r) for r in range(2)]
    states = _states(old, [MAX_TAKEN + 10, 0])
    with pytest.raises(TopologyChangeError, match="not in step"):
        ElasticSampler(Ids(n), seed=2, num_replicas=3, rank=0).elastic_resume(states, batch_size=None)
    with pytest.raises(OutOfStepError):
        GlobalPosition(0).advanced(2, [MAX_TAKEN + 10, 0], n)


@pytest.mark.parametrize("drop_last", [True, False])
def test_shares_and_advances_match_a_set_model_over_random_restarts(drop_last):
    """Against a brute-force model (the set of consumed positions, the pending list rebuilt and
    split as ``DistributedSampler`` splits an epoch): 200 restarts of random world sizes and
    counts, now and then out of step."""
    from goodput_ckpt.data.position import rank_share

    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 90)
        pos, done = GlobalPosition(0), set()
        for _ in range(rng.randint(1, 5)):
            w = rng.randint(1, 9)
            pending = [q for q in range(n) if q not in done]
            shares = [
                [pending[j] for j in rank_share(len(pending), w, r, drop_last=drop_last).tolist()] for r in range(w)
            ]
            for r in range(w):
                assert pos.share(n, w, r, drop_last=drop_last).tolist() == shares[r]
            low = rng.randint(0, len(shares[0]))
            counts = [min(len(shares[0]), low + (rng.randint(0, 3) if rng.random() < 0.2 else 0)) for _ in range(w)]
            try:
                pos = pos.advanced(w, counts, n)
            except OutOfStepError:
                break
            done.update(q for r in range(w) for q in shares[r][: counts[r]])
            assert {q for q in range(pos.start)} | set(pos.taken) == done
            assert len(pos.taken) <= MAX_TAKEN and all(t > pos.start for t in pos.taken)
