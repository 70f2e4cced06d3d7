"""The stall of ``dcp.async_save``: goodput-ckpt's ``CheckpointWriter`` against torch's
``FileSystemWriter``, with nothing else in the process (issue 21, a diagnostic).

``goodput-ckpt bench`` reported our stall at 2.3-2.65x torch's at 1 GiB, with per-repeat ratios
from 0.3x to 5.9x. Both writers stage the same way: ``dcp.async_save`` calls the writer's
``stage`` (torch's ``BlockingAsyncStager.stage`` and our ``stage_state_dict`` both call torch's
``_create_cpu_state_dict`` and ``_copy_state_dict``: fresh CPU memory, one copy), then hands the
write to a thread. This probe times exactly that, alternating the two writers (order swapped every
repeat), each save waited for, deleted and synced before the next, in a process that does nothing
else, so that no earlier phase of a benchmark decides whether the staging copy lands in memory
already faulted in.

Per method it prints the stall (time until ``async_save`` returns) and the total (until the save
is durable): min / median / max and every sample, then the per-repeat ratio ours / torch.

Run: ``.venv/bin/python benchmarks/probe_stall.py --size 1GiB --repeats 6``
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch.distributed.checkpoint as dcp

from goodput_ckpt.cli._output import parse_size
from goodput_ckpt.tools.measure._bench_methods import goodput_method, torch_method, wait_durable
from goodput_ckpt.tools.measure._bench_state import make_state

#: The writers ``goodput-ckpt bench`` times, at its defaults (the same factories).
WRITERS = {"ours": goodput_method(None, {}).writer, "torch": torch_method(None, {}, None).writer}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one in the current directory)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    state = make_state(parse_size(args.size)).nested
    scratch = tempfile.mkdtemp(prefix="probe-stall-", dir=args.dir or os.getcwd())
    stall: dict[str, list[float]] = {m: [] for m in WRITERS}
    total: dict[str, list[float]] = {m: [] for m in WRITERS}
    load0 = os.getloadavg()
    try:
        for rep in range(args.repeats):
            for name in list(WRITERS) if rep % 2 == 0 else list(WRITERS)[::-1]:
                where = os.path.join(scratch, f"{name}-{rep}")
                writer = WRITERS[name](where)
                gc.collect()
                time.sleep(1.0)
                t0 = time.perf_counter()
                fut = dcp.async_save(state, storage_writer=writer, no_dist=True)
                stall[name].append(time.perf_counter() - t0)
                fut.result()
                wait_durable(writer)
                total[name].append(time.perf_counter() - t0)
                del fut, writer
                shutil.rmtree(where)
                os.sync()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"{args.size}, {args.repeats} repeats, order swapped every repeat (ours first in repeat 1); load average "
        f"{load0[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    for name in WRITERS:
        s, t = stall[name], total[name]
        print(
            f"{name:<6} stall {min(s):.3f} / {statistics.median(s):.3f} / {max(s):.3f} s "
            f"{[round(x, 3) for x in s]}; until durable {statistics.median(t):.2f} s"
        )
    ratios = [a / b for a, b in zip(stall["ours"], stall["torch"])]
    print(f"stall ours / torch per repeat: {min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
