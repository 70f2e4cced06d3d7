"""One rank of the elastic acceptance job (test_elastic_acceptance.py).

Usage (one process per rank)::

    python elastic_job.py --rank R --world-size N --port P --root ROOT --log LOG --tag T \
        --workers W --steps S --save-every K [--batch B]

A DDP (gloo) linear model trained on a map-style dataset through an ``ElasticSampler`` and a
``StatefulDataLoader`` with ``W`` workers, the loop of docs/guide.md: restore, then epochs until
step ``S``, saving every ``K`` steps. Each sample carries an augmentation drawn from
``sample_generator(SEED, epoch, index)`` in the worker.

After every trained step each rank appends one line to ``LOG`` (one ``write`` of an ``O_APPEND``
file, before the step's save, so a committed step is always logged)::

    T step epoch rank world_size id:hex(sum of the sample's input) ...

With ``--tokens DIR`` the loader is a ``TokenStream`` over the shard files in ``DIR`` instead
(sequences of ``1 + DIM`` uint32 tokens: the sequence's id, then its input), and epoch is 0.

Rank 0 prints ``RESTORED s|none``, ``STEP s``, ``SAVED s`` and ``DONE`` (flushed) for the parent.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

N = 60  #: samples per epoch
BATCH = 2  #: per rank
SEED = 11  #: of the per-sample augmentation
DIM = 4


def augmentation(epoch: int, index: int) -> torch.Tensor:
    """The input of sample ``index`` in ``epoch``: drawn from its own generator, so it is the same
    whichever rank or worker reads it, before or after any restart."""
    from goodput_ckpt.data import sample_generator

    return torch.randn(DIM, generator=sample_generator(SEED, epoch, index))


class Samples(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.epoch = 0  # set by the loop before each iter(loader); workers get a copy then

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return i, augmentation(self.epoch, i)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    for name in ("--rank", "--world-size", "--port", "--workers", "--steps", "--save-every"):
        ap.add_argument(name, type=int, required=True)
    for name in ("--root", "--log", "--tag"):
        ap.add_argument(name, required=True)
    ap.add_argument("--tokens", help="read a TokenStream over the shards in this directory instead")
    ap.add_argument("--batch", type=int, default=BATCH, help="per-rank batch size")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world_size, timeout=datetime.timedelta(seconds=120))
    from torchdata.stateful_dataloader import StatefulDataLoader

    from goodput_ckpt import CheckpointManager
    from goodput_ckpt.data import ElasticSampler, TokenStream

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(DIM, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ds = Samples()
    sampler = ElasticSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = StatefulDataLoader(ds, batch_size=a.batch, sampler=sampler, num_workers=a.workers)
    if a.tokens:
        # Sequences of 1 + DIM uint32 tokens: the sequence's id, then its input. One pass, no epochs.
        names = sorted(p.name for p in Path(a.tokens).iterdir())
        stream = TokenStream(a.tokens, names, seq_len=1 + DIM, dtype="uint32", block=3)
        loader = StatefulDataLoader(stream, batch_size=a.batch, num_workers=a.workers)
    mgr = CheckpointManager(a.root, keep_last=2, async_save=False)
    last = mgr.restore(model=model, optimizer=opt, dataloader=loader)
    if a.rank == 0:
        print(f"RESTORED {'none' if last is None else last}", flush=True)
    step = 0 if last is None else last + 1
    epoch = sampler.epoch
    log = os.open(a.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    while step < a.steps:
        ds.epoch = epoch
        for batch in loader:
            if a.tokens:
                ids, x = batch[:, 0].long(), batch[:, 1:].double().float() / 1000
            else:
                ids, x = batch
            loss = nn.functional.mse_loss(model(x).squeeze(1), x.sum(dim=1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            items = " ".join(f"{i}:{float(v).hex()}" for i, v in zip(ids.tolist(), x.sum(dim=1)))
            os.write(log, f"{a.tag} {step} {epoch} {a.rank} {a.world_size} {items}\n".encode())
            if step % a.save_every == 0 or step == a.steps - 1:
                mgr.save(step, model=model, optimizer=opt, dataloader=loader)
                if a.rank == 0:
                    print(f"SAVED {step}", flush=True)
            if a.rank == 0:
                print(f"STEP {step}", flush=True)
            step += 1
            if step >= a.steps:
                break
        else:
            if a.tokens:
                raise RuntimeError(f"rank {a.rank}: the token stream ran out at step {step}")
            epoch += 1
            sampler.set_epoch(epoch)
    mgr.close()
    os.close(log)
    dist.barrier()
    dist.destroy_process_group()
    if a.rank == 0:
        print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
