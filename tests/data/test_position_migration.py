"""Version-1 elastic positions (a segment history, tests/data/fixtures/elastic_v1_positions.pt,
written by the version-1 code with make_v1_positions.py) still restore under version 2: the
elastic path and the same-topology path read exactly the samples version 1 read from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.datasets import Ids
from torchdata.stateful_dataloader import StatefulDataLoader

from goodput_ckpt.data import ElasticSampler
from goodput_ckpt.data.sampler import VERSION

FIXTURE = Path(__file__).parent / "fixtures" / "elastic_v1_positions.pt"
CASES = torch.load(FIXTURE, weights_only=True)


def test_the_fixture_is_version_1_and_this_code_writes_version_2():
    for case in CASES.values():
        for ls in case["states"]:
            st, _ = ElasticSampler.find_state(ls)
            assert st["goodput_elastic_sampler"] == 1 and "segments" in st["position"]
    assert VERSION == 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_version_1_position_resumes_elastically_on_the_same_samples(name):
    case = CASES[name]
    for world, want in case["expect"].items():
        for r in range(world):
            s = ElasticSampler(
                Ids(case["n"]), seed=case["seed"], drop_last=case["drop_last"], num_replicas=world, rank=r
            )
            s.elastic_resume(case["states"], batch_size=None)
            assert s.epoch == case["epoch"]
            assert list(s) == want[r], f"{name}: rank {r} of {world}"
            state = iter(s).state_dict()
            assert state["goodput_elastic_sampler"] == 2 and set(state["position"]) == {"epoch", "start", "taken"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_version_1_position_resumes_on_the_same_topology(name):
    case = CASES[name]
    ws = len(case["states"])
    for r, st in enumerate(case["states"]):
        s = ElasticSampler(Ids(case["n"]), seed=case["seed"], drop_last=case["drop_last"], num_replicas=ws, rank=r)
        loader = StatefulDataLoader(Ids(case["n"]), batch_size=1, sampler=s)
        loader.load_state_dict(st)
        s.adopt_saved_epoch(st)
        assert [int(x) for b in loader for x in b] == case["same"][r], f"{name}: rank {r}"
