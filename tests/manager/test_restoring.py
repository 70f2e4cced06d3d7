"""What a manager restore does besides the verified read (issue 38), counted, never timed.

- In a one-rank process group a manager makes no collective and no group of its own: every
  collective over one rank answers what the rank gave (``agreement.open_group``).
- A restore hands the optimizer's non-tensor values to the planner as the objects
  ``torch.load(weights_only=True)`` decoded: no ``torch.save`` and no unrestricted ``torch.load``
  round trip (``GridLoadPlanner.load_decoded``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from helpers.dist import run_ranks
from torch import nn

from goodput_ckpt import CheckpointManager

#: The torch.distributed entry points a manager, DCP or gloo group set-up would go through.
_COLLECTIVES = (
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather_object",
    "new_group",
    "reduce_scatter",
    "scatter_object_list",
)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    return model, opt


def _scrambled_equal(model: nn.Module, opt: torch.optim.Optimizer, restore) -> None:
    want = [t.clone() for t in model.state_dict().values()]
    want_opt = [v.clone() for s in opt.state.values() for v in s.values()]
    with torch.no_grad():
        for t in list(model.state_dict().values()) + [v for s in opt.state.values() for v in s.values()]:
            t.zero_()
    restore()
    assert all(torch.equal(a, b) for a, b in zip(want, model.state_dict().values(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(want_opt, [v for s in opt.state.values() for v in s.values()]))


def _count_collectives(calls: Counter) -> None:
    """Count every call of ``_COLLECTIVES`` in this process (both namespaces callers use)."""
    import torch.distributed.distributed_c10d as c10d

    for name in _COLLECTIVES:
        for owner in (dist, c10d):
            fn = getattr(owner, name, None)
            if fn is None:
                continue

            def counted(*a, _fn=fn, _name=name, **k):
                calls[_name] += 1
                return _fn(*a, **k)

            setattr(owner, name, counted)


def _one_rank(rank: int, world_size: int, where: str) -> None:
    assert dist.is_initialized() and world_size == 1
    calls: Counter = Counter()
    _count_collectives(calls)
    model, opt = _model()
    for label, kw in (("one tier", {}), ("two tiers", {"local_dir": f"{where}/local"})):
        root = f"{where}/{label.replace(' ', '-')}"
        with CheckpointManager(root, async_save=False, **kw) as mgr:
            mgr.save(1, model=model, optimizer=opt)
        with CheckpointManager(root, **kw) as mgr:
            _scrambled_equal(model, opt, lambda mgr=mgr: mgr.restore(model=model, optimizer=opt))
        assert not calls, f"{label}: a one-rank manager made collectives: {dict(calls)}"


def test_a_one_rank_group_costs_no_collective(tmp_path: Path):
    # Fails without open_group's one-rank rule: new_group at construction, then dcp.save's and
    # dcp.load's plan gathers, the manager's agreements and the restore's broadcasts.
    run_ranks(_one_rank, 1, str(tmp_path), report_dir=tmp_path / "reports", timeout=180)


def test_a_restore_decodes_each_value_once_with_weights_only(tmp_path: Path, monkeypatch):
    model, opt = _model()
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, model=model, optimizer=opt)
    loads: list[object] = []
    saves = Counter()
    real_load, real_save = torch.load, torch.save

    def load(*a, **k):
        loads.append(k.get("weights_only"))
        return real_load(*a, **k)

    def save(*a, **k):
        saves["torch.save"] += 1
        return real_save(*a, **k)

    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(torch, "save", save)
    with CheckpointManager(tmp_path) as mgr:
        _scrambled_equal(model, opt, lambda: mgr.restore(model=model, optimizer=opt))
    # AdamW's param_groups values (lr, betas, ..., params) are stored as objects: each is decoded
    # once, with weights_only, and handed over as is (before: re-saved, then loaded unrestricted).
    assert len(loads) >= len(opt.param_groups[0]) - 1 and set(loads) == {True}, loads
    assert not saves
