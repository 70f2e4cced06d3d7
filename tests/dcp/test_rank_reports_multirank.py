"""Rank reports on 2 real gloo ranks (dcp/rank_reports.py, dcp/commit_build.py): a save where
one rank's layout changed and the other's did not. The unchanged rank sends only its layout
digest; the coordinator, which must rebuild the entries for the changed rank, takes the unchanged
rank's rows from the build it holds. Before, that save failed ("sent only its layout digest"):
an incremental save's references add files on the ranks that have them, which is how
tests/manager/test_incremental_multirank.py found it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.dist import run_ranks

from goodput_ckpt import CheckpointReader, CheckpointWriter


def _state(rank: int, step: int, *, extra: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    out = {f"rank{rank}.w": torch.randn(64, 8, generator=g)}
    if extra and rank == 0:  # a key only rank 0 has: only its layout changes
        out["rank0.extra"] = torch.randn(16, generator=g)
    return out


def _worker(rank: int, world_size: int, root: str) -> None:
    sent = []

    class Recording(CheckpointWriter):
        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)
            sent.append(fut.value()[0].storage_data.writes is None)
            return fut

    for step, extra in ((1, False), (2, False), (3, True)):
        dcp.save(_state(rank, step, extra=extra), storage_writer=Recording(f"{root}/step{step}"))
    # Save 2: both ranks' layouts were held (no rows); save 3: rank 0's changed, rank 1's did not.
    assert sent == [False, True, rank == 1], sent
    for step, extra in ((2, False), (3, True)):
        want = _state(rank, step, extra=extra)
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(got, storage_reader=CheckpointReader(f"{root}/step{step}"))
        assert all(torch.equal(got[k], want[k]) for k in want), step
    dist.barrier()


def test_a_save_where_one_rank_changed_layout_commits_and_loads_bit_exact(tmp_path):
    run_ranks(_worker, 2, str(tmp_path), report_dir=tmp_path / "reports", timeout=300)
