"""``reshard --world-size M`` carries an ElasticSampler data position over (issue 17, issue 20
item 2) instead of refusing (``auto``) or dropping it (``drop``).

The multi-rank restore of a resharded checkpoint is in tests/state/test_bundle_elastic.py."""

from __future__ import annotations

import pytest
import torch
from helpers.samples import manifest
from torchdata.stateful_dataloader import StatefulDataLoader

from goodput_ckpt import CheckpointManager
from goodput_ckpt.data import ElasticSampler
from goodput_ckpt.tools.ops.reshard import reshard_checkpoint

N = 30


class Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def _loader():
    return StatefulDataLoader(Ids(), batch_size=4, sampler=ElasticSampler(Ids(), num_replicas=1, rank=0))


@pytest.fixture
def saved(tmp_path):
    """A 1-rank manager checkpoint at step 5, 3 batches into epoch 0; returns (step dir, ids seen)."""
    loader = _loader()
    it = iter(loader)
    seen = [i for _ in range(3) for i in next(it).tolist()]
    mgr = CheckpointManager(tmp_path / "run", async_save=False)
    mgr.save(5, model=torch.nn.Linear(3, 3), dataloader=loader)
    mgr.close()
    return tmp_path / "run" / "step_00000005", seen


def _rest(root) -> list[int]:
    loader = _loader()
    mgr = CheckpointManager(root, async_save=False)
    assert mgr.restore(model=torch.nn.Linear(3, 3), dataloader=loader) == 5
    mgr.close()
    return [i for b in loader for i in b.tolist()]


@pytest.mark.parametrize("policy", ["auto", "drop"])
def test_reshard_carries_the_data_position(saved, tmp_path, policy):
    src, seen = saved
    dst = tmp_path / "run2" / src.name
    r = reshard_checkpoint(str(src), str(dst), world_size=2, rank_state=policy)  # auto refused before
    assert "dataloader.rows" in r.per_rank_kept and "dataloader.rows" not in r.per_rank_dropped
    assert ("rng.rows" in r.per_rank_dropped) == (policy == "drop")
    ts = manifest(dst)["metadata"]["training_state"]
    if policy == "drop":
        assert ts["rng"] is None and ts["world_size"] == 2 and ts["dataloader"]["ranks"] == 1
    rest = _rest(tmp_path / "run2")  # one process restores what 2 ranks would (DCP reshards the model)
    assert sorted(seen + rest) == list(range(N)), "the position carried over: nothing repeated or lost"
