"""Incremental saves on 2 ranks: each rank references what it wrote itself (a replicated model,
whose tensors DCP saves once, and an FSDP2 model, each rank its shards), and the newest step
restores bit-exactly on every rank."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers.dist import run_ranks  # noqa: E402

from goodput_ckpt import CheckpointManager  # noqa: E402
from goodput_ckpt.format.manifest import parse_manifest  # noqa: E402


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    model[0].requires_grad_(False)
    return model


def _train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randn(4, 64, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _bases(root: str, step: int) -> set[str]:
    with open(os.path.join(root, f"step_{step:08d}", "manifest.json"), "rb") as f:
        return parse_manifest(f.read()).bases()


def _run(root: str, make) -> None:
    model = make(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mgr = CheckpointManager(root, keep_last=2, incremental=True, timeline=False)
    written = []
    for step in (1, 2, 3):
        _train(model, opt, step)
        mgr.save(step, model=model, optimizer=opt)
        mgr.wait()
        written.append((mgr.timeline[-1]["written_bytes"], mgr.timeline[-1]["referenced_bytes"]))
    mgr.close()
    assert written[0][1] == 0 and written[1][1] == written[2][1], written
    assert _bases(root, 3) == {"step_00000001"}
    fresh = make(5)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    again = CheckpointManager(root, keep_last=2, incremental=True, timeline=False)
    assert again.restore(model=fresh, optimizer=fresh_opt) == 3
    again.close()
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(_full(a), _full(b)), k


def _worker(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _run(os.path.join(root, "replicated"), _model)
    mesh = init_device_mesh("cpu", (world_size,))

    def sharded(seed: int) -> nn.Module:
        model = _model(seed)
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    _run(os.path.join(root, "fsdp"), sharded)


def test_incremental_saves_on_two_ranks(tmp_path):
    run_ranks(_worker, 2, str(tmp_path), report_dir=tmp_path / "reports", timeout=400)
