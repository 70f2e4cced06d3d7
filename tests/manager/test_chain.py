"""``manager.chain``: a job's storage as a chain of tiers, and the one typed object its restore
takes (``manager.restoring.RestoreTarget``), used directly in one process. The manager's own tests
(test_manager.py, test_tiers.py) run both chains through ``CheckpointManager``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from goodput_ckpt import CheckpointManager
from goodput_ckpt.dcp.collectives import Group
from goodput_ckpt.errors import CheckpointError
from goodput_ckpt.manager.chain import PersistentChain, open_chain
from goodput_ckpt.manager.config import ManagerConfig
from goodput_ckpt.manager.job import JobState, new_job_id
from goodput_ckpt.manager.restoring import RestoreTarget
from goodput_ckpt.manager.timeline import TimelineSink
from goodput_ckpt.state import Topology, normalize
from goodput_ckpt.storage import open_store


def _target(model: nn.Module, config: ManagerConfig, timeline: TimelineSink) -> RestoreTarget:
    return RestoreTarget(
        models=normalize(model, None),
        dataloader=None,
        stateful={},
        topology=Topology(0, 1),
        config=config,
        group=Group(None),
        timeline=timeline,
    )


def _chain(tmp_path, **options):
    config = ManagerConfig(**options)
    root = str(tmp_path / "root")
    return config, open_chain(
        config,
        root=open_store(root, {}),
        root_uri=root,
        storage_options={},
        group=Group(None),
        topology=Topology(0, 1),
        local_world_size=None,
        timeline=TimelineSink(None),
        on_failure=lambda step, err: None,
        job=JobState(new_job_id(), recorded=False),
    )


def test_one_tier_is_the_persistent_chain_and_restores_through_one_target(tmp_path):
    config, chain = _chain(tmp_path)
    assert isinstance(chain, PersistentChain) and chain.names == ("persistent",)
    assert chain.save_target(5) == (str(tmp_path / "root" / "step_00000005"), {})
    assert (
        chain.step_tiers() == {} and chain.restore(None, _target(nn.Linear(2, 2), config, TimelineSink(None))) is None
    )
    torch.manual_seed(0)
    saved = nn.Linear(2, 2)
    with CheckpointManager(tmp_path / "root", async_save=False) as mgr:
        mgr.save(3, model=saved)
    assert chain.step_tiers() == {3: ("persistent",)}
    model, timeline = nn.Linear(2, 2), TimelineSink(None)
    target = _target(model, config, timeline)
    restored = chain.restore(None, target)
    assert (restored.step, restored.where, restored.sources) == (3, str(tmp_path / "root" / "step_00000003"), None)
    assert torch.equal(model.weight, saved.weight), "the tensors part is read into the live parameters"
    assert not timeline.records, "recorded only once applied"
    target.apply(restored)
    assert torch.equal(model.weight, saved.weight) and timeline.records[-1]["step"] == 3


def test_two_tiers_are_local_replicas_persistent(tmp_path):
    config, chain = _chain(tmp_path, local_dir=str(tmp_path / "local"))
    try:
        assert chain.names == ("local", "replica", "persistent")
        uri, options = chain.save_target(1)
        assert uri.startswith(str(tmp_path / "local")) and options == {}
        assert chain.lists_steps() and chain.restore(None, _target(nn.Linear(2, 2), config, TimelineSink(None))) is None
    finally:
        chain.close()


def test_a_step_asked_for_that_no_tier_holds_is_refused_by_name(tmp_path):
    config, chain = _chain(tmp_path, local_dir=str(tmp_path / "local"))
    try:
        with pytest.raises(CheckpointError, match="no tier holds a committed checkpoint of step 7"):
            chain.restore(7, _target(nn.Linear(2, 2), config, TimelineSink(None)))
    finally:
        chain.close()
