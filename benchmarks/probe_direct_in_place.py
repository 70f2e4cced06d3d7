"""A manager's async saves with their page-aligned staging buffers written where they lie, against
the same saves with every chunk copied into a bounce buffer first (the write path before it).

One process, a ``CheckpointManager`` (async saves: staged, written around the page cache) over a
model of ``--layers`` 2048 x 2048 linear layers and AdamW (256 MiB with 16 layers), ``--repeats``
pairs of saves, the pair's order alternating; each save is timed from ``save`` until ``wait``
returns. The bounce-buffer way is the library's own path with ``direct_write._in_place``
answering no, so both ways stage, hash and write the same bytes to the same files. Prints wall and
process CPU seconds (every thread: staging copy, hashing, writing), min / median / max, and the
load average before and after. The first pair is dropped (it allocates the staging buffers).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/probe_direct_in_place.py --repeats 12``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from goodput_ckpt import CheckpointManager
from goodput_ckpt.storage import direct_write


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args(argv)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    real = direct_write._in_place
    ways = {"in place": real, "bounce": lambda view, pos: False}
    times: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    root = tempfile.mkdtemp(prefix="goodput-in-place-")
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    try:
        with CheckpointManager(root, keep_last=2, timeline=False) as mgr:
            step = 0
            for r in range(args.repeats + 1):
                for way in list(ways) if r % 2 == 0 else list(ways)[::-1]:
                    direct_write._in_place = ways[way]
                    step += 1
                    c0, t0 = time.process_time(), time.perf_counter()
                    mgr.save(step, model=model, optimizer=opt)
                    mgr.wait()
                    if r:
                        times[way].append((time.perf_counter() - t0, time.process_time() - c0))
    finally:
        direct_write._in_place = real
        shutil.rmtree(root, ignore_errors=True)
    for way, v in times.items():
        wall = sorted(x for x, _ in v)
        cpu = sorted(y for _, y in v)
        print(
            f"{way:9s} wall {wall[0]:.3f} / {statistics.median(wall):.3f} / {wall[-1]:.3f} s, "
            f"CPU {cpu[0]:.3f} / {statistics.median(cpu):.3f} / {cpu[-1]:.3f} s"
        )
    pairs = [b[1] / a[1] for a, b in zip(times["in place"], times["bounce"])]
    print(f"CPU, bounce / in place per pair: {min(pairs):.2f} / {statistics.median(pairs):.2f} / {max(pairs):.2f}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
