"""Async staging on 2 gloo ranks: a failed staging copy on one rank fails that save on every rank
(nothing is committed, and the next save pairs with the right step everywhere), and in-place
changes to FSDP2's DTensor parameters are seen like those of plain tensors."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_ranks  # noqa: E402
from helpers.manager_hooks import hold_saves, save_jobs_of, staging_of  # noqa: E402
from torch import nn

from goodput_ckpt import CheckpointError, CheckpointManager  # noqa: E402


def _held(root: Path) -> tuple[CheckpointManager, threading.Event]:
    """A manager whose save thread first waits for ``release.set()`` (the copy stays pending)."""
    mgr = CheckpointManager(root, keep_last=None, timeline=False)
    return mgr, hold_saves(mgr)


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, world_size: int, root: str) -> None:
    # -- one rank changes a parameter in place: the save fails everywhere -------------------------
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    mgr, release = _held(Path(root, "plain"))
    mgr.save(1, model=model, optimizer=opt)
    if rank == 1:
        with torch.no_grad():
            model[0].weight.mul_(2.0)
    release.set()
    _train(model, opt)
    with torch.no_grad():  # one model again (DCP saves each replicated tensor from one rank)
        for p in model.parameters():
            dist.broadcast(p, 0)
    want = _snapshot(model)
    mgr.save(2, model=model, optimizer=opt)
    with pytest.raises(CheckpointError, match=r"0\.weight changed in place"):
        mgr.wait()  # the failure of save 1, on rank 0 too (DCP gathered rank 1's error)
    mgr.wait()  # save 2 went through on both ranks
    assert mgr.steps() == [2], mgr.steps()
    assert not Path(root, "plain", "step_00000001", "manifest.json").exists()
    got = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    assert mgr.restore(model=got) == 2
    for k, v in want.items():
        assert torch.equal(got.state_dict()[k], v), k

    # -- staging itself fails on one rank (out of memory, say): that rank joins the others'
    # save with a failing one, so every rank fails step 3 and step 4 pairs everywhere ----------
    stager = staging_of(mgr).stager
    stage = stager.stage_deferred

    def out_of_memory(*args, **kwargs):
        raise MemoryError("cannot allocate the staging buffers")

    if rank == 1:
        stager.stage_deferred = out_of_memory
        with pytest.raises(CheckpointError, match="staging step 3.*cannot allocate"):
            mgr.save(3, model=model, optimizer=opt)
        stager.stage_deferred = stage
    else:
        mgr.save(3, model=model, optimizer=opt)
        with pytest.raises(CheckpointError, match="cannot allocate"):
            mgr.wait()
    mgr.save(4, model=model, optimizer=opt)
    mgr.wait()
    assert mgr.steps() == [2, 4], mgr.steps()
    mgr.close()

    # -- fail_fast with a failure only one rank saw (a staged upload's durability, say) --------
    fmgr = CheckpointManager(Path(root, "fail-fast"), keep_last=None, timeline=False, fail_fast=True)
    fmgr.save(1, model=model, optimizer=opt)
    fmgr.wait()
    if rank == 1:
        # A failure this rank alone saw, reported as the save thread reports one.
        save_jobs_of(fmgr).report_failure(1, CheckpointError("the upload of step 1 never became durable"))
        with pytest.raises(CheckpointError, match="never became durable"):
            fmgr.save(2, model=model, optimizer=opt)
    else:
        fmgr.save(2, model=model, optimizer=opt)  # joined by rank 1's failing save
        with pytest.raises(CheckpointError, match="never became durable"):
            fmgr.wait()
    fmgr.save(3, model=model, optimizer=opt)
    fmgr.close()
    assert fmgr.steps() == [1, 3], fmgr.steps()

    # -- FSDP2: an in-place change of a DTensor parameter is seen --------------------------------
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(1)
    fmodel = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    fully_shard(fmodel[0], mesh=mesh)
    fully_shard(fmodel, mesh=mesh)
    fopt = torch.optim.AdamW(fmodel.parameters(), lr=1e-2)
    _train(fmodel, fopt)
    assert isinstance(fmodel[0].weight, DTensor)
    fmgr, release = _held(Path(root, "fsdp"))
    fmgr.save(1, model=fmodel, optimizer=fopt)
    assert not staging_of(fmgr).guard.pending.done, "the DTensor shards' copies were deferred"
    with torch.no_grad():
        fmodel[0].weight.mul_(2.0)  # bumps the DTensor's version counter, not its shard's
    release.set()
    _train(fmodel, fopt)
    with pytest.raises(CheckpointError, match=r"0\.weight changed in place"):
        fmgr.wait()
    assert fmgr.steps() == []
    fmgr.close()


@pytest.mark.multiproc
def test_a_staging_failure_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    run_ranks(_worker, 2, str(tmp_path), report_dir=tmp_path / "reports", timeout=240)
