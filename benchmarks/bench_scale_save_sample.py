"""What a first save's payloads weigh per rank at a W too large to simulate whole (16,384), from a
sample of ranks: the sizes behind the coordinator's memory there (docs/scale.md), counted, not
timed.

For each sampled rank this runs the rank's own steps on its simulated state (the state of
``bench_scale_save_sim.py``: 70B + AdamW, FSDP2 ``Shard(0)``, empty shards past a tensor's end):
``ReplicaGroupingSavePlanner.create_local_plan`` (its compact plan, pickled as ``gather_object``
pickles it), then its final items as the coordinator's compact step gives them (its shards; the
replicated values kept on rank 0 only, as the planner's rule puts them) and its write report from
``rank_report`` (pickled; packed rows), and the rows unpacked as the coordinator's first build
holds them (the table's bytes). It prints the largest and the mean of each over the sample, and
what they make at W: the gathers padded to the largest payload (``gather_object``), the tables
the build holds at once, the plan cache's per-rank boxes.

Run: ``python benchmarks/bench_scale_save_sample.py --world 16384 --sample 64``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys

import numpy as np
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

sys.path.insert(0, os.path.dirname(__file__))
from bench_scale_save_sim import ours_results, state_dict  # noqa: E402

from goodput_ckpt.dcp.compact_plan import CompactFinal, final_items  # noqa: E402
from goodput_ckpt.dcp.rank_reports import RankAssignment, unpack  # noqa: E402
from goodput_ckpt.dcp.save_planner import ReplicaGroupingSavePlanner  # noqa: E402


def one_rank(layout: str, rank: int, world: int) -> dict[str, int]:
    planner = ReplicaGroupingSavePlanner()
    planner.set_up_planner(state_dict=state_dict(layout, rank, world), storage_meta=None, is_coordinator=rank == 0)
    plan = planner.create_local_plan()
    sent = plan.planner_data
    items = planner._items
    own = [i for i, it in enumerate(items) if it.type != WriteItemType.SHARD] if rank == 0 else []
    final = CompactFinal(np.array(own, dtype=np.int32).tobytes(), rank, world)
    mine = SavePlan(final_items(items, final), storage_data=RankAssignment(rank, "abcdef123456"))
    results = ours_results(mine)
    report = results[0].storage_data
    rows = unpack(report.writes, report.files, rank, {})
    return {
        "items": len(items),
        "plan": len(pickle.dumps(plan)),
        "boxes": len(sent.boxes),
        "schema": len(sent.schema),
        "mappings": len(sent.mappings or b""),
        "results": len(pickle.dumps(results)),
        "table": rows.table.nbytes,
        "keys": len(rows.keys),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="70B")
    ap.add_argument("--world", type=int, default=16384)
    ap.add_argument("--sample", type=int, default=64)
    args = ap.parse_args(argv)
    W = args.world
    ranks = sorted({0, 1, W // 2, *range(0, W, max(1, W // args.sample))})
    rows = [one_rank(args.layout, r, W) for r in ranks]
    print(f"{args.layout} W={W}: {len(ranks)} ranks sampled ({ranks[:4]} ... {ranks[-1]})")
    for k in rows[0]:
        vals = [r[k] for r in rows]
        print(f"  {k:<9} max {max(vals):>9,}  mean {statistics.mean(vals):>11,.0f}  rank 0 {rows[0][k]:>9,}")
    mean = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
    mx = {k: max(r[k] for r in rows) for k in rows[0]}
    mb = 1e6
    print(f"at W={W:,} (est. from the sample):")
    print(f"  plans gathered, padded to the largest:   {W * mx['plan'] / mb:8.0f} MB")
    print(f"  results gathered, padded to the largest: {W * mx['results'] / mb:8.0f} MB")
    print(f"  unpacked tables the first build holds:   {W * mean['table'] / mb:8.0f} MB")
    print(f"  plan cache, boxes per rank:              {W * mean['boxes'] / mb:8.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
