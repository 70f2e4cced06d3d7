"""Tensor items resolved in the writer threads (``dcp/write_sources.py`` ``LazyTensorSource``)
against resolved on the calling thread before any byte is written (the path before it).

One process, the synthetic model-plus-optimizer state of ``bench_physical.py``
(``goodput_ckpt.tools.measure._bench_state``, ``--size``, 501 tensors at 256 MiB), ``--repeats``
pairs of ``dcp.save`` through ``CheckpointWriter`` on a local temporary directory, the pair's
order alternating; the eager way is the library's own ``resolve_item`` with every tensor item
resolved at once, so both write the same bytes. Prints, min / median / max over the pairs after
the first: the calling thread's CPU inside ``CheckpointWriter._write_rank`` (the save's serial
part that the change moves) and the save's wall time, and the load average before and after.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/probe_lazy_resolve.py --repeats 12``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointWriter
from goodput_ckpt.cli._output import parse_size
from goodput_ckpt.dcp import write_sources
from goodput_ckpt.dcp import writer as writer_module
from goodput_ckpt.tools.measure._bench_state import make_state


def _eager(item, planner):
    """Every tensor item resolved now, on the calling thread (the code before the change)."""
    if item.type != write_sources.WriteItemType.BYTE_IO and item.tensor_data is not None:
        return write_sources._tensor_source(item, planner.resolve_data(item))
    return write_sources.resolve_item(item, planner)


def _spread(values: list[float], scale: float = 1.0) -> str:
    v = sorted(values)
    return f"{v[0] * scale:.3f} / {statistics.median(v) * scale:.3f} / {v[-1] * scale:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args(argv)
    state = make_state(parse_size(args.size)).flat
    ways = {"lazy": write_sources.resolve_item, "eager": _eager}
    serial: dict[str, list[float]] = {w: [] for w in ways}
    wall: dict[str, list[float]] = {w: [] for w in ways}
    real_write_rank = writer_module.CheckpointWriter._write_rank
    way = ["lazy"]

    def write_rank(self, *a):
        c0 = time.thread_time()
        try:
            return real_write_rank(self, *a)
        finally:
            serial[way[0]].append(time.thread_time() - c0)

    writer_module.CheckpointWriter._write_rank = write_rank
    root = tempfile.mkdtemp(prefix="goodput-lazy-")
    print(f"state {args.size}, {len(state)} tensors; load average before {os.getloadavg()[0]:.1f}")
    try:
        for r in range(args.repeats + 1):
            for w in list(ways) if r % 2 == 0 else list(ways)[::-1]:
                way[0] = w
                writer_module.resolve_item = ways[w]
                path = os.path.join(root, f"{r}-{w}")
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=CheckpointWriter(path), no_dist=True)
                wall[w].append(time.perf_counter() - t0)
                shutil.rmtree(path)
    finally:
        writer_module.CheckpointWriter._write_rank = real_write_rank
        writer_module.resolve_item = write_sources.resolve_item
        shutil.rmtree(root, ignore_errors=True)
    for w in ways:  # the first pair warms up
        print(
            f"{w:5s} _write_rank calling-thread CPU ms {_spread(serial[w][1:], 1e3)}; save wall s {_spread(wall[w][1:])}"
        )
    print(f"load average after {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
