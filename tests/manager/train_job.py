"""One rank of the small training job of the resume acceptance test (test_resume.py).

Usage (one process per rank; the parent sets nothing else)::

    python train_job.py --rank R --world-size N --port P --out DIR --steps S \
        [--root ROOT --save-every K]            # with CheckpointManager (restores, then saves)
        [--allow-topology-change] [--elastic]

Without ``--root`` it is the reference run: the same job with the same seeds and no manager at
all. The job: an FSDP2 (``fully_shard``) MLP with dropout, per-rank RNG seeds (torch, Python,
NumPy all drawn from in every step), a shuffling ``StatefulDataLoader`` with 2 workers over a
per-rank dataset, AdamW and a LambdaLR schedule, async saves every K steps and at the last step.

Prints ``STEP s`` after every step and ``SAVED s`` once ``save`` returned (the save is then in the
background), ``RESTORED s|none`` after the restore and ``DONE`` at the end, all flushed, so the
parent can SIGKILL the job at chosen moments. At the end every rank writes ``DIR/rank{R}.pt``:
rank 0 the full (unsharded) parameters, optimizer state and scheduler state; every rank its RNG
states and the next batches its dataloader would yield.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

WIDTH = 256  # ~0.8 MB of parameters, ~2.4 MB with AdamW state: saves take a few ms to tens of ms
SAMPLES = 96
BATCH = 8


class Samples(torch.utils.data.Dataset):
    """Deterministic per-rank samples (no randomness in the workers)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(10_000 * (self.rank + 1) + i)
        x = torch.randn(WIDTH, generator=g)
        return x, x.sin().sum(dim=0, keepdim=True)


def build(rank: int, world_size: int, elastic: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(1234)  # the same initial weights on every rank
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(WIDTH, 1),
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    # Per-rank seeds for everything a step draws from.
    torch.manual_seed(1000 + rank)
    random.seed(2000 + rank)
    np.random.seed(3000 + rank)
    # The loader gets its own generator: creating an iterator draws a seed from it, and it must
    # not draw from the global RNG (which a resumed run restores to the saved step).
    if elastic:  # issue 17: the same job with goodput_ckpt.data.ElasticSampler is bit-exact too
        from goodput_ckpt.data import ElasticSampler

        sampler = ElasticSampler(Samples(rank), seed=4000, num_replicas=world_size, rank=rank)
        loader = StatefulDataLoader(
            Samples(rank), batch_size=BATCH, sampler=sampler, num_workers=2,
            generator=torch.Generator().manual_seed(4000 + rank),
        )  # fmt: skip
        return model, opt, sched, loader
    loader = StatefulDataLoader(
        Samples(rank), batch_size=BATCH, shuffle=True, num_workers=2,
        generator=torch.Generator().manual_seed(4000 + rank),
    )  # fmt: skip
    return model, opt, sched, loader


def train_step(model, opt, sched, x, y) -> None:
    noise = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())  # Python and NumPy RNG
    out = model(x * noise + 0.01 * torch.randn_like(x))  # torch RNG (and dropout)
    loss = nn.functional.mse_loss(out, y)
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--root")
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--elastic", action="store_true", help="an ElasticSampler instead of shuffle=True")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=args.rank, world_size=args.world_size, timeout=datetime.timedelta(seconds=120)
    )
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    model, opt, sched, loader = build(args.rank, args.world_size, args.elastic)
    step = 0
    mgr = None
    if args.root:
        from goodput_ckpt import CheckpointManager

        mgr = CheckpointManager(args.root, keep_last=2, async_save=True)
        last = mgr.restore(model=model, optimizer=opt, dataloader=loader, scheduler=sched)
        print(f"RESTORED {'none' if last is None else last}", flush=True)
        step = 0 if last is None else last + 1
    while step < args.steps:
        for x, y in loader:
            train_step(model, opt, sched, x, y)
            if mgr is not None and (step % args.save_every == 0 or step == args.steps - 1):
                mgr.save(step, model=model, optimizer=opt, dataloader=loader, scheduler=sched, extra={"step": step})
                print(f"SAVED {step}", flush=True)
            print(f"STEP {step}", flush=True)
            step += 1
            if step >= args.steps:
                break
    if mgr is not None:
        mgr.close()

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    result = {
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()[1].copy()},
        "next_batches": [batch[0].clone() for batch, _ in zip(loader, range(3))],
    }
    msd = get_model_state_dict(model, options=full)
    osd = get_optimizer_state_dict(model, opt, options=full)
    if args.rank == 0:
        result.update(model=msd, optimizer=osd, scheduler=sched.state_dict())
    torch.save(result, os.path.join(args.out, f"rank{args.rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
