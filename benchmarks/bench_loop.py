"""A whole training loop with an injected failure: torch's default DCP writer against ours (issue 38).

The loop is torchtitan's ``async_mode="async"`` pattern: every ``--every`` steps it waits for the
previous save's future, then calls ``dcp.async_save`` on the model's and AdamW's state dicts
(``get_model_state_dict``/``get_optimizer_state_dict``, FQN keys) into a fresh step directory, and
goes on training. At step ``--kill-at`` every rank kills itself (SIGKILL, whatever save is in
flight dies with it); a new set of processes then restores the last *complete* checkpoint (ours:
its commit record ``manifest.json`` exists; torch's: its ``.metadata`` exists, the file
``FileSystemWriter`` writes last) and trains on to ``--steps``. Batches are drawn from a generator
seeded by the step, so the resumed run recomputes the lost steps exactly.

Methods, the same loop and model each:

- ``torch``: ``FileSystemWriter`` (its defaults: staging into fresh CPU memory, ``sync_files=True``)
  and ``FileSystemReader``;
- ``ours``: ``CheckpointWriter`` at its defaults (an async save writes its data files around the
  page cache: ``LocalConfig.direct_writes``) and ``CheckpointReader(verify=True)``;
- ``ours-buffered``: the same with ``direct_writes=False`` (every write through the page cache, the
  default before session 18), to show what the direct writes buy in the same run.

Figures, per method, min / median / max over ``--repeats`` (the order of the methods rotates by
one per repeat):

- ``stall``: per save, the seconds the loop is blocked: waiting for the previous save plus
  ``async_save`` itself (staging and planning), the worst rank;
- ``goodput``: useful seconds / total seconds. Useful: ``--steps`` x the undisturbed step time
  (the median of both methods' steps before their first save, in the same repeat: one figure for
  both, so within a repeat the goodputs compare the totals), what the loop would take without
  checkpoints or failures. Total: the first run's loop until the kill, the restore, and the resumed
  run's loop including the wait for its last save. What goodput loses is split into the steps'
  slowdown while a save runs beside them, the lost (recomputed) steps, the stalls, the restore, the
  final wait and the rest. Process start-up (``import torch``) is left out of both:
  it is the same for both writers, and on a loaded machine it would swamp the rest;
- ``lost``: steps recomputed after the kill; ``restore``: seconds of the restore; where the total
  went (as above; the rest is logging and the loop itself); how long a save ran in the background
  (``async_save``'s return to its future's end, the ``saved`` event written by a callback on the
  save's thread).

Ranks: ``--ranks`` processes on one machine in a gloo group (gradients all-reduced: a
data-parallel replica each; DCP then saves one copy). Each worker writes one JSON line per event
to a log, flushed at once, so the figures of a killed run survive it.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_loop.py --ranks 1 --repeats 3 --json loop.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from goodput_ckpt.tools.measure._bench_measure import rotated
from goodput_ckpt.tools.measure._bench_measure import spread_of as _stats

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

METHODS = ("torch", "ours", "ours-buffered")
_WORKER_TIMEOUT_S = 900  # one process of a small run; bounds a hung gloo group


# -- the worker: one rank of one run (the first, killed; or the resumed one) ----------------------
def _complete(method: str, path: Path) -> bool:
    from goodput_ckpt.format.schema import MANIFEST_NAME

    return (path / (".metadata" if method == "torch" else MANIFEST_NAME)).is_file()


def _writer(method: str, path: Path):
    import torch.distributed.checkpoint as dcp

    from goodput_ckpt import CheckpointWriter

    if method == "torch":
        return dcp.FileSystemWriter(str(path))
    return (
        CheckpointWriter(str(path), direct_writes=False) if method == "ours-buffered" else CheckpointWriter(str(path))
    )


def _reader(method: str, path: Path):
    import torch.distributed.checkpoint as dcp

    from goodput_ckpt import CheckpointReader

    return dcp.FileSystemReader(str(path)) if method == "torch" else CheckpointReader(str(path), verify=True)


def worker(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # Both libraries are imported before the clock starts, whichever method runs: an import is
    # process start-up (left out, like ``import torch``), not a cost of the first save or restore.
    from goodput_ckpt import CheckpointReader, CheckpointWriter  # noqa: F401

    torch.set_num_threads(1)
    rank = int(os.environ["BENCH_RANK"])
    root = Path(a.root)
    log = open(root / f"log-{a.phase}-rank{rank}.jsonl", "a", buffering=1)

    def event(**kw: Any) -> None:
        log.write(json.dumps({"t": time.perf_counter(), **kw}) + "\n")

    dist.init_process_group("gloo", init_method=f"file://{root}/pg-{a.phase}", rank=rank, world_size=a.ranks)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(a.layers):
        layers += [nn.Linear(a.width, a.width), nn.ReLU()]
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state() -> dict[str, Any]:
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}

    def train_step(step: int) -> None:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(a.batch, a.width, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.ranks > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= a.ranks
        opt.step()

    start = 0
    event(kind="ready")
    if a.phase == "resume":
        steps = sorted((int(p.name.split("-")[1]) for p in root.glob("step-*") if _complete(a.method, p)), reverse=True)
        if steps:
            t = time.perf_counter()
            train_step(0)  # creates AdamW's state, which the load then overwrites
            sd = state()
            dcp.load(sd, storage_reader=_reader(a.method, root / f"step-{steps[0]}"))
            set_model_state_dict(model, sd["model"])
            set_optimizer_state_dict(model, opt, sd["optim"])
            start = steps[0]
            event(kind="restore", step=start, seconds=time.perf_counter() - t)
        else:
            event(kind="restore", step=0, seconds=0.0)
    fut = None
    for step in range(start + 1, a.steps + 1):
        t = time.perf_counter()
        train_step(step)
        event(kind="step", step=step, seconds=time.perf_counter() - t)
        if a.phase == "first" and step == a.kill_at:
            event(kind="kill", step=step)
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if step % a.every == 0:
            t = time.perf_counter()
            if fut is not None:
                fut.result()  # torchtitan waits for the previous save before the next
            waited = time.perf_counter() - t
            fut = dcp.async_save(state(), storage_writer=_writer(a.method, root / f"step-{step}"))
            event(kind="save", step=step, stall=time.perf_counter() - t, waited=waited)
            fut.add_done_callback(lambda f, s=step: event(kind="saved", step=s))  # on the save's thread
    t = time.perf_counter()
    if fut is not None:
        fut.result()
    event(kind="end", final_wait=time.perf_counter() - t)
    dist.destroy_process_group()
    return 0


# -- the driver ---------------------------------------------------------------------------------
def _launch(a: argparse.Namespace, method: str, root: Path, phase: str) -> None:
    args = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--method",
        method,
        "--phase",
        phase,
        "--root",
        str(root),
        "--ranks",
        str(a.ranks),
        "--steps",
        str(a.steps),
        "--every",
        str(a.every),
        "--kill-at",
        str(a.kill_at),
        "--width",
        str(a.width),
        "--layers",
        str(a.layers),
        "--batch",
        str(a.batch),
    ]
    repo = str(Path(__file__).resolve().parents[1])  # the workers import goodput_ckpt from this tree
    path = os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])])
    procs = [
        subprocess.Popen(args, env={**os.environ, "BENCH_RANK": str(r), "PYTHONPATH": path}) for r in range(a.ranks)
    ]
    for p in procs:
        try:
            p.wait(timeout=_WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    expected = -signal.SIGKILL if phase == "first" else 0
    codes = [p.returncode for p in procs]
    if any(c != expected for c in codes):
        raise RuntimeError(f"{method} {phase}: workers exited {codes}, expected {expected}")


def _events(root: Path, phase: str, rank: int) -> list[dict[str, Any]]:
    with open(root / f"log-{phase}-rank{rank}.jsonl") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def one_run(a: argparse.Namespace, method: str, root: Path) -> dict[str, Any]:
    """The first run (killed), then the resumed one; the figures of the worst rank."""
    root.mkdir()
    _launch(a, method, root, "first")
    _launch(a, method, root, "resume")
    per_rank = []
    for r in range(a.ranks):
        first, resume = _events(root, "first", r), _events(root, "resume", r)
        restore = next(e for e in resume if e["kind"] == "restore")
        kill = next(e for e in first if e["kind"] == "kill")
        ready1, ready2 = first[0]["t"], resume[0]["t"]
        end = next(e for e in resume if e["kind"] == "end")
        total = (kill["t"] - ready1) + (end["t"] - ready2)
        undisturbed = [e["seconds"] for e in first if e["kind"] == "step" and e["step"] <= a.every]
        stepped = sum(e["seconds"] for e in first + resume if e["kind"] == "step")
        stalls = [e["stall"] for e in first + resume if e["kind"] == "save"]
        lost_s = sum(e["seconds"] for e in first if e["kind"] == "step" and e["step"] > restore["step"])
        # How long each save ran in the background: from async_save's return to its future's end.
        returned = {
            (log, e["step"]): e["t"]
            for log, events in (("first", first), ("resume", resume))
            for e in events
            if e["kind"] == "save"
        }
        background = [
            e["t"] - returned[(log, e["step"])]
            for log, events in (("first", first), ("resume", resume))
            for e in events
            if e["kind"] == "saved" and (log, e["step"]) in returned
        ]
        per_rank.append(
            {
                "total": total,
                "undisturbed": undisturbed,
                "stepped": stepped,
                "restore": restore["seconds"],
                "restored_step": restore["step"],
                "lost": a.kill_at - restore["step"],
                "lost_s": lost_s,
                "stall_s": sum(stalls),
                "final_wait": end["final_wait"],
                "other_s": total - stepped - sum(stalls) - restore["seconds"] - end["final_wait"],
                "background_median": statistics.median(background) if background else 0.0,
                "stall_median": statistics.median(stalls),
                "stall_max": max(stalls),
                "saves": len(stalls),
            }
        )
    shutil.rmtree(root)
    worst = max(per_rank, key=lambda x: x["total"])
    worst["stall_median"] = max(x["stall_median"] for x in per_rank)
    worst["stall_max"] = max(x["stall_max"] for x in per_rank)
    return worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=1, choices=(1, 2))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="save every k steps")
    p.add_argument("--kill-at", type=int, default=22, help="the step after which every rank is killed")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=("first", "resume"), help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    if not 0 < a.every <= a.kill_at < a.steps:
        p.error("need 0 < --every <= --kill-at < --steps")
    if a.repeats < 1:
        p.error("--repeats must be at least 1")

    state_bytes = 3 * 4 * a.layers * (a.width * a.width + a.width)  # weights, exp_avg, exp_avg_sq in fp32
    base = Path(tempfile.mkdtemp(prefix="goodput-loop-", dir=a.dir))
    load0 = os.getloadavg()
    print(
        f"{a.ranks} rank(s), {a.layers} x Linear({a.width}) + AdamW ({state_bytes / (1 << 20):.0f} MiB of state), "
        f"{a.steps} steps, async save every {a.every}, kill after step {a.kill_at}; {a.repeats} repeats; "
        f"load average {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f}, {os.cpu_count()} CPUs"
    )
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    orders = []
    try:
        for rep in range(a.repeats):
            order = rotated(list(METHODS), rep)
            orders.append(order)
            for m in order:
                runs[m].append(one_run(a, m, base / f"{m}-{rep}"))
            # A step's undisturbed time: the median of both methods' steps before their first save
            # (one figure for both, so that within a repeat goodput compares the totals; a step
            # slowed down by a save running beside it is not useful time).
            ideal = statistics.median(x for m in METHODS for x in runs[m][-1]["undisturbed"])
            for m in METHODS:
                r = runs[m][-1]
                r.update(
                    ideal_step=ideal,
                    useful=a.steps * ideal,
                    goodput=a.steps * ideal / r["total"],
                    slowdown_s=r["stepped"] - r["lost_s"] - a.steps * ideal,
                )
            print(
                f"repeat {rep + 1}: order {', '.join(order)}; "
                + "; ".join(
                    f"{m} goodput {runs[m][-1]['goodput']:.3f}, restored step {runs[m][-1]['restored_step']}"
                    for m in order
                )
                + f"; load average {os.getloadavg()[0]:.1f}"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    load1 = os.getloadavg()
    report: dict[str, Any] = {
        "ranks": a.ranks,
        "state_bytes": state_bytes,
        "steps": a.steps,
        "every": a.every,
        "kill_at": a.kill_at,
        "order": orders,
        "load_average": [load0[0], load1[0]],
        "methods": {},
    }
    print(
        f"\n{'method':<14}{'goodput min':>12}{'median':>8}{'max':>7}{'stall s median':>16}{'(max)':>8}"
        f"{'lost steps':>11}{'restore s':>10}"
    )
    for m in METHODS:
        fig = {
            k: _stats([r[k] for r in runs[m]])
            for k in (
                "goodput",
                "stall_median",
                "stall_max",
                "lost",
                "restore",
                "total",
                "useful",
                "ideal_step",
                "slowdown_s",
                "lost_s",
                "stall_s",
                "final_wait",
                "other_s",
                "background_median",
            )
        }
        report["methods"][m] = fig
        g = fig["goodput"]
        print(
            f"{m:<14}{g['min']:>12.3f}{g['median']:>8.3f}{g['max']:>7.3f}{fig['stall_median']['median']:>16.3f}"
            f"{fig['stall_max']['median']:>8.3f}{fig['lost']['median']:>11.0f}{fig['restore']['median']:>10.3f}"
        )
    print(
        "\nwhere the total went, seconds (medians): useful (steps x undisturbed step) / steps' slowdown beside "
        "saves / lost steps / stalls / restore / final wait / other; a save's median time in the background"
    )
    for m in METHODS:
        f = report["methods"][m]
        print(
            f"{m:<14}"
            + " / ".join(
                f"{f[k]['median']:.2f}"
                for k in ("useful", "slowdown_s", "lost_s", "stall_s", "restore", "final_wait", "other_s")
            )
            + f"; background {f['background_median']['median']:.2f} s"
        )
    report["ours_vs_torch"] = {}
    for m in METHODS[1:]:
        ratio = [o["goodput"] / t["goodput"] for o, t in zip(runs[m], runs["torch"])]
        stall = [t["stall_median"] / o["stall_median"] for o, t in zip(runs[m], runs["torch"])]
        report["ours_vs_torch"][m] = {"goodput": _stats(ratio), "stall": _stats(stall)}
        print(
            f"{m} vs torch, same repeat: goodput ratio {statistics.median(ratio):.2f} "
            f"({min(ratio):.2f}-{max(ratio):.2f}), stall (torch's / {m}'s) {statistics.median(stall):.2f} "
            f"({min(stall):.2f}-{max(stall):.2f})"
        )
    print(f"load average at the end {load1[0]:.1f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
