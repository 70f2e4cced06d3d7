"""What one async save costs a training loop, per writer, in one process (issue 38's probe).

Each round runs, for every method in a rotating order, one ``dcp.async_save`` of a model's and
AdamW's state followed by ``--steps`` training steps and the wait for the save, plus one window of
the same steps with no save (``none``). Checkpoints are kept until the end, as a training loop
keeps them (on a VM whose free memory goes back to the host, a save into memory that was just
freed costs far less CPU than one that needs new pages).

Printed per method, median (min-max) over ``--rounds``:

- ``cost``: the window's wall seconds minus the same round's window without a save;
- ``background``: ``async_save``'s return to the end of its future;
- ``save CPU``: the CPU seconds of every thread but the training thread during the window (the
  save's threads: planning, hashing, copies, writes, commit; staging runs on the training thread
  and is the same for every method).

Methods: ``torch`` (``FileSystemWriter``), ``ours`` (``CheckpointWriter`` at its defaults: async
saves write their data files direct), ``ours-buffered`` (``direct_writes=False``).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/probe_loop_save.py --rounds 12``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from goodput_ckpt import CheckpointWriter
from goodput_ckpt.tools.measure._bench_measure import rotated

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

METHODS = ("torch", "ours", "ours-buffered")


def _writer(method: str, path: str):
    if method == "torch":
        return dcp.FileSystemWriter(path)
    return CheckpointWriter(path, direct_writes=False) if method == "ours-buffered" else CheckpointWriter(path)


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:6.0f} ({min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=8, help="training steps after each save")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dir", default=tempfile.gettempdir())
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="goodput-probe-loop-", dir=a.dir)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(a.layers):
            layers += [nn.Linear(a.width, a.width), nn.ReLU()]
        model = nn.Sequential(*layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(i: int) -> None:
            x = torch.randn(64, a.width, generator=torch.Generator().manual_seed(i))
            loss = model(x).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        for i in range(10):
            step(i)
        names = [*METHODS, "none"]
        window: dict[str, list[float]] = {m: [] for m in names}
        background: dict[str, list[float]] = {m: [] for m in METHODS}
        save_cpu: dict[str, list[float]] = {m: [] for m in names}
        load0 = os.getloadavg()[0]
        for r in range(a.rounds):
            for m in rotated(names, r):
                c0, m0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
                fut = None
                if m != "none":
                    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
                    fut = dcp.async_save(state, storage_writer=_writer(m, f"{root}/{m}-{r}"))
                    ts = time.perf_counter()
                    fut.add_done_callback(lambda f, ts=ts, m=m: background[m].append(time.perf_counter() - ts))
                for i in range(a.steps):
                    step(i)
                if fut is not None:
                    fut.result()
                window[m].append(time.perf_counter() - t0)
                save_cpu[m].append((time.process_time() - c0) - (time.thread_time() - m0))
                time.sleep(0.2)
        print(
            f"{a.rounds} rounds, {a.steps} steps per window, {a.layers} x Linear({a.width}) + AdamW; "
            f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; ms, median (min-max)"
        )
        print(f"{'method':<14}{'cost':>18}{'background':>18}{'save CPU':>18}")
        for m in METHODS:
            cost = [w - b for w, b in zip(window[m], window["none"])]
            print(f"{m:<14}{_spread(cost):>18}{_spread(background[m]):>18}{_spread(save_cpu[m]):>18}")
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
