"""``dcp.collectives.Group``: every collective the package makes, with the single-process answer
built in (the multi-rank answers are exercised by every gloo test of the manager and the tiers)."""

from __future__ import annotations

import pytest
import torch

from goodput_ckpt.dcp.collectives import Group


def test_one_process_answers_every_collective_locally():
    group = Group(None)
    assert group.single and (group.rank, group.world_size) == (0, 1)
    assert group.gather({"a": 1}) == [{"a": 1}]
    assert group.broadcast("mine") == "mine"
    flat = torch.arange(4, dtype=torch.uint8)
    assert group.broadcast_bytes(flat) is flat
    assert group.device() == torch.device("cpu")


def test_the_default_group_without_torch_distributed_is_one_process():
    assert Group.default().single


def _collectives(rank: int, world: int, out: str) -> None:
    import json
    from pathlib import Path

    import torch.distributed as dist

    group = Group(dist.new_group(backend="gloo"))
    flat = torch.full((3,), 7, dtype=torch.uint8) if rank == 0 else torch.zeros(3, dtype=torch.uint8)
    got = [group.gather(rank * 10), group.broadcast(f"from {rank}"), group.broadcast_bytes(flat).tolist(), group.rank]
    Path(out, f"rank{rank}.json").write_text(json.dumps(got))


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_two_ranks_gather_and_broadcast(tmp_path):
    import json

    from helpers.dist import run_ranks

    run_ranks(_collectives, 2, str(tmp_path), report_dir=tmp_path / "report", timeout=120)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == [[0, 10], "from 0", [7, 7, 7], rank]
