"""S3 requests per rank, by operation, for a real save and restore at W = 2 ... 16 gloo ranks.

Issue 19's rules for object stores: no rank LISTs but the coordinator (once per restore); no
HEAD storm; O(1) requests per rank for its own data, plus the coordinator's O(ranks). This
counts them on the real code path: W gloo processes run ``helpers.s3_requests.
count_rank_requests`` against a real S3 server on 127.0.0.1 (SeaweedFS by default, or moto), each
rank counting the requests its own boto3 client makes (a ``before-parameter-build`` hook on the
session the store builds its client from). Phases, each between barriers:

- ``dcp.save``: bench_scale's ``tiny`` layout (441 tensors, FSDP ``Shard(0)`` DTensors) through
  ``dcp.save`` and ``CheckpointWriter``;
- ``dcp.load``: the same through ``dcp.load`` and ``CheckpointReader`` (checked bit-exact);
- ``manager.save``: an FSDP2 model of ``--layers`` linear layers plus AdamW through
  ``CheckpointManager.save`` (synchronous, ``keep_last=2``): the manager's first save, step 1;
- ``manager.steady``: the same manager's save of step 4 (after steps 2 and 3), which retires
  step 2: the steady state (docs/s3.md, *Requests per save*);
- ``manager.restore``: a new manager (a restarted job) restores the latest step (4).

For each W and phase it prints the coordinator's requests by operation and the most any other
rank made (``coordinator / max other``). Counts do not depend on timing, so every repeat should
give the same figures; a cell that differs between repeats shows ``min-median-max``. Each run's
wall time (spawn, save, restore) is printed as min / median / max over repeats, with the order
the runs went in and the load average.

Run: ``.venv/bin/python benchmarks/bench_requests.py --ranks 2,4,8 --json requests.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the servers, the workload
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_scale's layouts
from helpers.dist import run_ranks  # noqa: E402
from helpers.s3 import MotoServer, SeaweedServer, s3_env  # noqa: E402
from helpers.s3_requests import PHASES, count_rank_requests  # noqa: E402

BUCKET = "goodput-requests"


def _cell(values: list[int]) -> str:
    if min(values) == max(values):
        return str(values[0])
    return f"{min(values)}-{statistics.median(values):g}-{max(values)}"


def summarize(reports: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, list[int]]]]:
    """``{phase: {operation: {"coordinator": [per repeat], "max_other": [...], "min_other": [...]}}}``."""
    out: dict[str, dict[str, dict[str, list[int]]]] = {}
    for phase in PHASES:
        ops = sorted({op for r in reports for ranks in [r[phase]] for counts in ranks for op in counts})
        out[phase] = {
            op: {
                "coordinator": [r[phase][0].get(op, 0) for r in reports],
                "max_other": [max(c.get(op, 0) for c in r[phase][1:]) for r in reports],
                "min_other": [min(c.get(op, 0) for c in r[phase][1:]) for r in reports],
            }
            for op in ops
        }
        out[phase]["total"] = {
            key: [sum(v[key][i] for v in out[phase].values()) for i in range(len(reports))]
            for key in ("coordinator", "max_other", "min_other")
        }
    return out


def print_table(worlds: list[int], summary: dict[int, dict[str, Any]]) -> None:
    print("\nrequests by operation: coordinator / most of any other rank (min of the other ranks where it differs)")
    head = "| phase | operation | " + " | ".join(f"W={w}" for w in worlds) + " |"
    print(head)
    print("|" + "---|" * (len(worlds) + 2))
    for phase in PHASES:
        ops = sorted({op for w in worlds for op in summary[w][phase]}, key=lambda op: (op == "total", op))
        for op in ops:
            cells = []
            for w in worlds:
                v = summary[w][phase].get(op)
                if v is None:
                    cells.append("0 / 0")
                    continue
                cell = f"{_cell(v['coordinator'])} / {_cell(v['max_other'])}"
                if v["min_other"] != v["max_other"]:
                    cell += f" ({_cell(v['min_other'])})"
                cells.append(cell)
            name = f"**{op}**" if op == "total" else op
            print(f"| {phase} | {name} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4,8", help="world sizes, comma-separated (each W costs ~300 MB per rank)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--server", choices=("seaweedfs", "moto"), default="seaweedfs")
    ap.add_argument("--layers", type=int, default=16, help="linear layers of the manager's FSDP2 model")
    ap.add_argument("--json", help="write the per-rank counts and the summary here")
    args = ap.parse_args()
    worlds = [int(w) for w in args.ranks.split(",")]

    from bench_scale import model_tensors

    shapes = [(t.fqn, t.shape) for t in model_tensors("tiny")]
    os.environ.update(s3_env())
    print(
        f"{len(shapes)} tensors (bench_scale 'tiny', Shard(0)); manager: {args.layers} FSDP2 layers + AdamW; "
        f"server {args.server}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    order: list[str] = []
    reports: dict[int, list[dict[str, Any]]] = {w: [] for w in worlds}
    walls: dict[int, list[float]] = {w: [] for w in worlds}
    with tempfile.TemporaryDirectory(prefix="bench-requests-") as tmp:
        server = SeaweedServer(Path(tmp, "weed")) if args.server == "seaweedfs" else MotoServer()
        try:
            import boto3

            boto3.client("s3", endpoint_url=server.url, region_name="us-east-1").create_bucket(Bucket=BUCKET)
            for rep in range(args.repeats):
                # Rotate the order of world sizes per repeat (counts do not depend on it; times may).
                run_order = worlds[rep % len(worlds) :] + worlds[: rep % len(worlds)]
                order.append(f"repeat {rep}: W={','.join(map(str, run_order))}")
                for w in run_order:
                    out = Path(tmp, f"w{w}-r{rep}.json")
                    t0 = time.perf_counter()
                    run_ranks(
                        count_rank_requests,
                        w,
                        server.url,
                        f"s3://{BUCKET}/w{w}-r{rep}",
                        shapes,
                        args.layers,
                        str(out),
                        report_dir=Path(tmp, f"ranks-w{w}-r{rep}"),
                        timeout=600,
                    )
                    walls[w].append(time.perf_counter() - t0)
                    reports[w].append(json.loads(out.read_text()))
                    print(
                        f"  W={w} repeat {rep}: {walls[w][-1]:.1f} s, load average {os.getloadavg()[0]:.1f}", flush=True
                    )
        finally:
            server.stop()
    print("order:", "; ".join(order))
    for w in worlds:
        ts = sorted(walls[w])
        print(
            f"  W={w}: run wall time min {ts[0]:.1f} / median {statistics.median(ts):.1f} / max {ts[-1]:.1f} s ({len(ts)} repeats)"
        )
    summary = {w: summarize(reports[w]) for w in worlds}
    print_table(worlds, summary)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"worlds": worlds, "order": order, "walls": walls, "summary": summary, "reports": reports}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
