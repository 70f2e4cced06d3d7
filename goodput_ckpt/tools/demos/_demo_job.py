"""One rank of the demo's training job (``goodput-ckpt demo`` starts it; not a public API).

Usage (the demo starts one process per rank)::

    python -m goodput_ckpt.tools.demos._demo_job --rank R --world-size N --port P --out DIR \\
        --steps S --width W [--root URI --save-every K --timeline FILE [-o KEY=VALUE ...]]

The job: an FSDP2 (``fully_shard``) MLP with dropout, per-rank seeds (each step draws from the
torch, Python and NumPy RNGs), a shuffling ``StatefulDataLoader`` with 2 workers over per-rank
synthetic data, AdamW and a LambdaLR schedule. The manager's resume test runs this same job
(``tests/manager/train_job.py``).
With ``--root`` it runs under :class:`~goodput_ckpt.CheckpointManager` (restore, then an async
save every K steps and at the last step); without it, it is the reference run: the same job with
the same seeds and no checkpointing at all.

It prints, flushed, one line per event (``T`` is ``time.time()``)::

    READY T                     process group up, model built
    RESTORED step|none T        after the restore
    STEP s T seconds            after each training step (the step's wall time)
    SAVED s T stall             once save() returned (the write continues in the background)
    SYNC seconds                the blocking-save probe (see below)
    DONE T

At the end each rank writes ``DIR/fingerprint-rank{R}.json``: blake3 digests of what a resumed
run must reproduce bit for bit (rank 0: the full parameters, optimizer state and scheduler state;
every rank: its RNG states and the next batches of its dataloader; :func:`state_fingerprint`). With ``--sync-probe`` the
managed run then times a blocking ``dcp.save`` of the same state with torch's stock
``FileSystemWriter`` (the "synchronous checkpoint" the report compares against).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import sys
import time
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

SAMPLES = 512
BATCH = 16
DEPTH = 4


class Samples(torch.utils.data.Dataset):
    """Deterministic per-rank samples: the workers draw no randomness."""

    def __init__(self, rank: int, width: int) -> None:
        self.rank, self.width = rank, width

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100_000 * (self.rank + 1) + i)
        x = torch.randn(self.width, generator=g)
        return x, x[: self.width // 2].sin() * x[self.width // 2 :].cos()


def device_for(rank: int, world_size: int) -> torch.device:
    """A GPU per rank when there are enough of them, else the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return torch.device("cuda", rank)
    return torch.device("cpu")


def make_model(width: int) -> nn.Sequential:
    """The job's MLP, unsharded, with fresh weights."""
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)]
    return nn.Sequential(*layers, nn.Linear(width, width // 2))


def make_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """The job's optimizer and learning-rate schedule for ``model``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.01 * s))


def build(rank: int, world_size: int, width: int, device: torch.device, *, elastic: bool = False) -> tuple[Any, ...]:
    """The job's model, optimizer, scheduler and loader. ``elastic``: the loader draws its order
    from ``goodput_ckpt.data.ElasticSampler`` (a position that survives a topology change)
    instead of ``shuffle=True``; the same topology resumes bit for bit either way."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(1234)  # the same initial weights on every rank
    model = make_model(width).to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, sched = make_optimizer(model)
    torch.manual_seed(1000 + rank)  # per-rank dropout and noise
    if device.type == "cuda":
        torch.cuda.manual_seed(1000 + rank)
    random.seed(2000 + rank)
    np.random.seed(3000 + rank)
    # Its own generator: creating an iterator draws from it, never from the global RNG.
    order: dict[str, Any] = {"shuffle": True}
    if elastic:
        from ...data import ElasticSampler

        order = {"sampler": ElasticSampler(Samples(rank, width), seed=4000, num_replicas=world_size, rank=rank)}
    loader = StatefulDataLoader(
        Samples(rank, width),
        batch_size=BATCH,
        num_workers=2,
        generator=torch.Generator().manual_seed(4000 + rank),
        **order,
    )
    return model, opt, sched, loader


def train_step(model: nn.Module, opt: Any, sched: Any, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> None:
    x, y = x.to(device), y.to(device)
    jitter = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())  # Python's and NumPy's RNGs too
    out = model(x * jitter + 0.01 * torch.randn_like(x))
    nn.functional.mse_loss(out, y).backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _digest(value: Any) -> Any:
    import blake3

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8)
        return f"{t.dtype}{list(t.shape)}:{blake3.blake3(raw.numpy().tobytes()).hexdigest()[:32]}"
    if isinstance(value, dict):
        return {str(k): _digest(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_digest(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, list) and obj and not isinstance(obj[0], (int, float, str)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}", out)
    else:
        out[prefix] = obj
    return out


def state_fingerprint(model: nn.Module, opt: Any, sched: Any) -> dict[str, Any]:
    """Digests of the full (unsharded) parameters, optimizer state and scheduler state, keyed
    ``model.*``, ``optimizer.*``, ``scheduler.*`` (a collective when the model is sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=full)
    osd = get_optimizer_state_dict(model, opt, options=full)
    return _flatten(_digest({"model": msd, "optimizer": osd, "scheduler": sched.state_dict()}), "", {})


def fingerprint(rank: int, model: nn.Module, opt: Any, sched: Any, loader: Any, device: torch.device) -> dict[str, Any]:
    """Digests of everything an exact resume must reproduce (a collective: every rank calls it)."""
    state: dict[str, Any] = {
        "rng.torch": torch.get_rng_state(),
        "rng.python": random.getstate(),
        "rng.numpy": [torch.from_numpy(np.random.get_state()[1].copy()), *np.random.get_state()[2:]],
        "next_batches": [batch[0] for batch, _ in zip(loader, range(2))],
    }
    if device.type == "cuda":
        state["rng.cuda"] = torch.cuda.get_rng_state(device)
    full_state = state_fingerprint(model, opt, sched)
    prints = _flatten(_digest(state), "", {})
    return {**prints, **full_state} if rank == 0 else prints


def sync_probe(model: nn.Module, opt: Any, out: str) -> float:
    """Seconds a blocking ``dcp.save`` of the model and optimizer state takes with torch's
    stock ``FileSystemWriter`` into ``out/sync-probe`` (removed afterwards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = os.path.join(out, "sync-probe")
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    msd, osd = get_state_dict(model, opt)
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save({"model": msd, "optimizer": osd}, storage_writer=dcp.FileSystemWriter(path))
    seconds = time.perf_counter() - t0
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    return seconds


def _emit(*parts: Any) -> None:
    print(" ".join(str(p) for p in parts), flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--root")
    ap.add_argument("--save-every", type=int, default=25)
    ap.add_argument("--timeline")
    ap.add_argument("--sync-probe", action="store_true")
    ap.add_argument("--elastic", action="store_true", help="order the data with ElasticSampler")
    ap.add_argument("-o", dest="options", action="append", default=[], help="KEY=JSON store option")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)  # deterministic kernels, and the ranks share few cores
    device = device_for(args.rank, args.world_size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(True, warn_only=True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    dist.init_process_group(
        backend, rank=args.rank, world_size=args.world_size, timeout=datetime.timedelta(seconds=300)
    )
    model, opt, sched, loader = build(args.rank, args.world_size, args.width, device, elastic=args.elastic)
    _emit("READY", time.time())
    step, mgr = 0, None
    if args.root:
        from goodput_ckpt import CheckpointManager

        options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.options)}
        mgr = CheckpointManager(args.root, keep_last=3, timeline=args.timeline or True, **options)
        last = mgr.restore(model=model, optimizer=opt, dataloader=loader, scheduler=sched)
        _emit("RESTORED", "none" if last is None else last, time.time())
        step = 0 if last is None else last + 1
    while step < args.steps:
        for x, y in loader:
            t0 = time.perf_counter()
            train_step(model, opt, sched, x, y, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            if mgr is not None and (step % args.save_every == 0 or step == args.steps - 1):
                t1 = time.perf_counter()
                mgr.save(
                    step, model=model, optimizer=opt, dataloader=loader, scheduler=sched, extra={"demo_step": step}
                )
                _emit("SAVED", step, time.time(), time.perf_counter() - t1)
            _emit("STEP", step, time.time(), seconds)
            step += 1
            if step >= args.steps:
                break
    if mgr is not None:
        mgr.close()
    prints = fingerprint(args.rank, model, opt, sched, loader, device)
    with open(os.path.join(args.out, f"fingerprint-rank{args.rank}.json"), "w") as f:
        json.dump(prints, f, indent=0, sort_keys=True)
    if args.sync_probe:
        _emit("SYNC", sync_probe(model, opt, args.out))
    dist.barrier()
    dist.destroy_process_group()
    _emit("DONE", time.time())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
