"""Training-loop stall per checkpoint: synchronous save, torch's async save, and CheckpointManager.

One run builds one model (a stack of ``Linear`` layers plus small ``LayerNorm``s) and its AdamW
state, and measures on that same state the time a training loop is blocked by one save:

- ``copy``: one copy of every tensor of the state into preallocated, already-touched CPU memory
  (the floor for any save that copies the state before it lets training continue);
- ``sync``: ``dcp.save`` with ``CheckpointWriter`` (the whole save blocks); ``sync-torch``: the
  same with torch's ``FileSystemWriter`` at its defaults;
- ``torch-async``: ``dcp.async_save`` with torch's ``FileSystemWriter``, whose default staging
  copies into fresh memory on every save (blocks until staged);
- ``torch-async-staging``: ``dcp.async_save`` with torch's ``DefaultStager`` and
  ``use_async_staging=True`` (staging in a background thread); its stall is the time
  ``async_save`` blocks plus the wait for ``staging_completion``, which a training loop must
  make before its next optimizer step;
- ``writer-async``: ``dcp.async_save`` with ``CheckpointWriter`` and no stager: the writer's
  own staging, also into fresh memory;
- ``manager-blocking``: ``CheckpointManager(async_staging=False).save(...)`` (model, optimizer,
  RNG): the whole copy, into buffers reused from the previous save, before ``save`` returns;
- ``manager``: ``CheckpointManager()`` with its default async staging: ``save`` copies only what
  a forward pass may change and returns; the parameters and optimizer state are copied behind
  the next training step's forward and backward, and that step's ``optimizer.step()`` waits for
  what is left. Its stall is the time ``save`` blocks plus that wait (the timeline's
  ``guard_s``).

Each manager save is followed by one training step (``step-after-*``: the step that overlaps
the start of the background work). Every async save is waited for (outside the timed region)
before the next one starts, so a stall never includes the previous write. The first save of
each manager (which allocates the buffers) is reported apart as ``*-first``. Then it times
training steps with no save running (``step-idle``) and while a manager save writes in the
background (``step-during-save``), and what a save costs the loop in all (``cost-*``): the wall
time of a save plus the training steps taken until it has committed, minus as many idle steps.
The stall is only part of that cost: the background copy and write slow the steps that run
beside them. A blocking save costs its stall (``cost-sync``). Each figure is the median over
``--repeats`` saves (steps: over every step taken).

Run: ``.venv/bin/python benchmarks/bench_stall.py --size 1GiB --repeats 5 --json stall.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from goodput_ckpt.cli._output import parse_size

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", category=FutureWarning)

MiB = 1 << 20
WIDTH = 2048  # one Linear is 16 MiB of weights


def build(total_bytes: int, batch: int):
    """A model whose parameters plus AdamW state take about ``total_bytes`` (3x the weights)."""
    layers = max(1, round(total_bytes / 3 / (WIDTH * WIDTH * 4)))
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)]
    model = nn.Sequential(*mods)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, WIDTH)

    def forward_backward() -> None:
        model(x).square().mean().backward()

    def optimizer_step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    forward_backward()
    optimizer_step()  # creates the optimizer state
    return model, opt, forward_backward, optimizer_step


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for s in opt.state.values():
        out += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1GiB", help="parameters + optimizer state (default 1GiB)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    scratch = tempfile.mkdtemp(prefix="bench-stall-", dir=args.dir)
    try:
        return _run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(args: argparse.Namespace, scratch: str) -> int:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from goodput_ckpt import CheckpointManager, CheckpointWriter

    torch.manual_seed(0)
    model, opt, forward_backward, optimizer_step = build(parse_size(args.size), args.batch)

    def train_step() -> None:
        forward_backward()
        optimizer_step()

    tensors = state_tensors(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(
        f"state: {nbytes / MiB:.0f} MiB in {len(tensors)} tensors; {args.repeats} saves each; "
        f"torch threads {torch.get_num_threads()}; scratch {scratch}",
        flush=True,
    )
    res: dict[str, float] = {}
    counter = iter(range(10**9))

    def fresh_dir() -> str:
        return os.path.join(scratch, f"c{next(counter)}")

    def clean_files() -> None:
        for name in os.listdir(scratch):
            if name not in ("mgr", "mgr-overlap"):
                shutil.rmtree(os.path.join(scratch, name), ignore_errors=True)

    # Methods run round-robin within each repeat (the start rotating), so that load from other
    # processes on a shared machine hits them alike; ratios are also taken per repeat.
    bufs = [torch.empty_like(t) for t in tensors]
    for b, t in zip(bufs, tensors):
        b.copy_(t)  # touch every page once: this is the reused-memory floor

    def sd():
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optimizer": osd}

    managers = {
        "manager-blocking": CheckpointManager(os.path.join(scratch, "mgr"), keep_last=1, async_staging=False),
        "manager": CheckpointManager(os.path.join(scratch, "mgr-overlap"), keep_last=1),
    }

    def timed_save(m: CheckpointManager, step: int) -> tuple[float, float]:
        """One manager save and the training step after it: (stall, that step's time)."""
        t0 = time.perf_counter()
        m.save(step, model=model, optimizer=opt)
        dt = time.perf_counter() - t0
        t1 = time.perf_counter()
        train_step()  # its optimizer step waits for the rest of an async staging copy
        step_s = time.perf_counter() - t1
        m.wait()
        (record,) = [r for r in m.timeline[-1:] if r["event"] == "save" and r["ok"]]
        return dt + record["guard_s"], step_s

    for name, m in managers.items():
        res[f"{name}-first"] = 1e3 * timed_save(m, 0)[0]  # allocates the staging buffers
    steps = iter(range(1, 10**9))
    after: dict[str, list[float]] = {name: [] for name in managers}

    def run_copy() -> float:
        t0 = time.perf_counter()
        for b, t in zip(bufs, tensors):
            b.copy_(t)
        return time.perf_counter() - t0

    def run_sync(make) -> float:
        t0 = time.perf_counter()
        dcp.save(sd(), storage_writer=make(fresh_dir()))
        return time.perf_counter() - t0

    def run_async(make) -> float:
        t0 = time.perf_counter()
        fut = dcp.async_save(sd(), storage_writer=make(fresh_dir()))
        dt = time.perf_counter() - t0
        fut.result()
        return dt

    def run_torch_async_staging() -> float:
        """Like the manager's: staging overlaps the next forward and backward, and the loop waits
        for it before the optimizer step (as torch's docs ask)."""
        stager = DefaultStager(StagingOptions(False, False, True, False))
        t0 = time.perf_counter()
        resp = dcp.async_save(sd(), storage_writer=dcp.FileSystemWriter(fresh_dir()), async_stager=stager)
        dt = time.perf_counter() - t0
        forward_backward()
        t1 = time.perf_counter()
        resp.staging_completion.result()
        dt += time.perf_counter() - t1
        optimizer_step()
        resp.upload_completion.result()
        stager.close()
        return dt

    def run_manager(name: str) -> float:
        stall, step_s = timed_save(managers[name], next(steps))
        after[name].append(step_s)
        return stall

    methods = {
        "copy": run_copy,
        "sync": lambda: run_sync(lambda p: CheckpointWriter(p)),
        "sync-torch": lambda: run_sync(lambda p: dcp.FileSystemWriter(p)),
        "torch-async": lambda: run_async(lambda p: dcp.FileSystemWriter(p)),
        "torch-async-staging": run_torch_async_staging,
        "writer-async": lambda: run_async(lambda p: CheckpointWriter(p)),
        "manager-blocking": lambda: run_manager("manager-blocking"),
        "manager": lambda: run_manager("manager"),
    }
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            times[n].append(methods[n]())
            clean_files()
    for n in names:
        res[n] = median_ms(times[n])
    for name, xs in after.items():
        res[f"step-after-{name}"] = median_ms(xs)
    bufs.clear()

    # -- what a save costs the training loop in all ----------------------------------------------
    # A save's stall is not its whole cost: the background copy and write share the machine with
    # the steps taken meanwhile and slow them. Each window is one save plus training steps until
    # that save has committed; its cost is the window's wall time minus as many idle steps.
    idle: list[float] = []
    busy: list[float] = []  # steps taken while the default manager's save runs
    windows: dict[str, list[tuple[float, int]]] = {name: [] for name in managers}
    for i in range(args.repeats):
        for _ in range(2):  # idle steps, interleaved with the busy ones (shared machine)
            t0 = time.perf_counter()
            train_step()
            idle.append(time.perf_counter() - t0)
        order = list(managers) if i % 2 == 0 else list(reversed(managers))
        for name in order:
            m = managers[name]
            t_save = time.perf_counter()
            m.save(next(steps), model=model, optimizer=opt)
            n = 0
            while n == 0 or m.in_flight_step is not None:
                t0 = time.perf_counter()
                train_step()
                if name == "manager":
                    busy.append(time.perf_counter() - t0)
                n += 1
                if n > 1000:
                    break
            m.wait()
            windows[name].append((time.perf_counter() - t_save, n))
    for m in managers.values():
        m.close()
    res["step-idle"] = median_ms(idle)
    res["step-during-save"] = median_ms(busy) if busy else float("nan")
    idle_s = statistics.median(idle)
    for name, ws in windows.items():
        res[f"cost-{name}"] = median_ms([wall - n * idle_s for wall, n in ws])
    res["cost-sync"] = res["sync"]  # a blocking save costs its stall: nothing runs beside it

    def per_repeat(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    ratios = {
        "manager / copy": res["manager"] / res["copy"],
        "manager / copy (median per repeat)": per_repeat("manager", "copy"),
        "manager-blocking / copy": res["manager-blocking"] / res["copy"],
        "sync / manager": res["sync"] / res["manager"],
        "sync / manager (median per repeat)": per_repeat("sync", "manager"),
        "sync-torch / manager": res["sync-torch"] / res["manager"],
        "sync / manager-blocking": res["sync"] / res["manager-blocking"],
        "torch-async / manager": res["torch-async"] / res["manager"],
        "torch-async-staging / manager": res["torch-async-staging"] / res["manager"],
        "writer-async / manager": res["writer-async"] / res["manager"],
        "step-after-manager / step-after-manager-blocking": res["step-after-manager"]
        / res["step-after-manager-blocking"],
        "step-during-save / step-idle": res["step-during-save"] / res["step-idle"],
        "cost-manager / cost-manager-blocking": res["cost-manager"] / res["cost-manager-blocking"],
        "cost-sync / cost-manager": res["cost-sync"] / res["cost-manager"],
        "cost-sync / cost-manager-blocking": res["cost-sync"] / res["cost-manager-blocking"],
    }
    print(f"\n{'measure':<32}{'ms':>10}")
    for k, v in res.items():
        print(f"{k:<32}{v:>10.1f}")
    print(f"\n{'ratio':<50}{'value':>8}   target")
    targets = {
        "manager / copy": "<= 1.25",
        "manager / copy (median per repeat)": "<= 1.25",
        "sync / manager": ">= 10",
        "sync / manager (median per repeat)": ">= 10",
        "sync-torch / manager": ">= 10",
    }
    for k, v in ratios.items():
        print(f"{k:<50}{v:>8.2f}   {targets.get(k, '')}")
    steps_per_window = statistics.median(n for _, n in windows["manager"])
    print(f"\nsteps per save window (manager, median): {steps_per_window}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "state_bytes": nbytes,
                    "repeats": args.repeats,
                    "ms": res,
                    "ratios": ratios,
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
