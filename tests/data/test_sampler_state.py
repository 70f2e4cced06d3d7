"""Splitting an ElasticSampler's saved state into the job-level record and a rank's part, and
joining them back (``data/_sampler_state.py``); restores through the manager are in
tests/state/test_job_position.py."""

from __future__ import annotations

import copy

import pytest
from helpers.datasets import Ids
from torchdata.stateful_dataloader import StatefulDataLoader

from goodput_ckpt.data import ElasticSampler
from goodput_ckpt.data.sampler import MARK
from goodput_ckpt.errors import CheckpointError, TopologyChangeError


def _live_state(workers: int) -> tuple[dict, ElasticSampler]:
    s = ElasticSampler(Ids(30), seed=2, num_replicas=2, rank=1)
    loader = StatefulDataLoader(Ids(30), batch_size=2, sampler=s, num_workers=workers)
    it = iter(loader)
    next(it), next(it)
    return loader.state_dict(), s


@pytest.mark.parametrize("workers", [0, 2])
def test_a_split_leaves_the_live_state_and_a_join_gives_it_back(workers):
    live, s = _live_state(workers)
    before = copy.deepcopy(live)
    row, job = ElasticSampler.split_job_state(live)
    assert live == before, "the loader's own state is not changed"
    assert set(ElasticSampler.find_state(row)[0]) == {MARK, "rank", "consumed", "job"}
    assert job["position"] == {"epoch": 0, "start": 0, "taken": []} and job["world_size"] == 2
    assert s.join_job_state(copy.deepcopy(row), job) == before


def test_a_row_of_another_position_is_refused():
    live, s = _live_state(0)
    row, job = ElasticSampler.split_job_state(live)
    other = {**job, "position": {"epoch": 0, "start": 2, "taken": []}}
    with pytest.raises(TopologyChangeError, match="not the job's"):
        s.join_job_state(row, other)


def test_a_state_a_restore_would_refuse_is_not_split():
    live, _ = _live_state(0)
    ElasticSampler.find_state(live)[0]["position"]["epoch"] = -1
    row, job = ElasticSampler.split_job_state(live)
    assert row is live and job is None, "kept whole in the row, where the restore refuses it by name"


def test_a_second_sampler_part_in_a_row_is_refused_after_the_join():
    live, s = _live_state(0)
    row, job = ElasticSampler.split_job_state(live)
    row["dataset_state"] = {"x": dict(ElasticSampler.find_state(row)[0])}  # a second part, nested
    with pytest.raises(CheckpointError, match="2 ElasticSampler states"):
        s.prepare_elastic_resume([s.join_job_state(row, job)], batch_size=2)
