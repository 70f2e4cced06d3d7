"""Lightning's default checkpointing against goodput-ckpt's plugin, on the same training run.

Each method trains the same model (seeded; a stack of ``--layers`` square linear layers of width
``--width``, Adam, so the checkpoint holds the model and two optimizer moments) with a real
``lightning.Trainer`` on the CPU for ``--epochs`` epochs of one step each; ``ModelCheckpoint``
saves after every epoch. Two times per save: the *stall* (how long the training thread spends in
the plugin's ``save_checkpoint``) and the *save* (how long the inner plugin takes to write it;
for a synchronous plugin the two are the same call). The last checkpoint is loaded once with
``load_checkpoint`` (timed) to check that it reads back.

Methods:
- ``torch``: Lightning's default ``TorchCheckpointIO`` (``torch.save`` of the whole dict into one
  file, no fsync: the file may sit in the page cache when the save returns);
- ``torch+fsync``: the same, then the file fsynced (durable, as ours is);
- ``goodput``: ``GoodputCheckpointIO()`` (raw bytes hashed with blake3, every file fsynced, the
  manifest committed last; the load verifies every chunk);
- ``torch-async``: Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())``;
- ``goodput-async``: ``AsyncGoodputCheckpointIO()`` (Lightning's wrapper, removals in order).

Rules: the first save of each run is a warm-up (the machine hands back memory that sat free, and
the first touch of it is slow: docs/benchmarks.md, Noise) and is not counted; each repeat runs
the methods in an order rotated by one, and deletes its files afterwards. Printed: min, median and
max over the repeats of each run's median save time, and the load time likewise.

    python benchmarks/bench_lightning.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from goodput_ckpt.integrations.lightning import AsyncGoodputCheckpointIO, GoodputCheckpointIO

warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)


class _Model(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class _FsyncTorchIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        super().save_checkpoint(checkpoint, path, storage_options)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _timed(base: type):
    class Timed(base):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            self.save_s: list[float] = []

        def save_checkpoint(self, *a, **k):
            t = time.perf_counter()
            super().save_checkpoint(*a, **k)
            self.save_s.append(time.perf_counter() - t)

    return Timed


def _plugins(method: str):
    """(the plugin the Trainer gets, the timed plugin that writes, the timed plugin the loop calls)."""
    if method.endswith("-async"):
        inner = (_timed(TorchCheckpointIO) if method.startswith("torch") else _timed(GoodputCheckpointIO))()
        outer = (_timed(AsyncCheckpointIO) if method.startswith("torch") else _timed(AsyncGoodputCheckpointIO))(inner)
        return outer, inner, outer
    io = {
        "torch": _timed(TorchCheckpointIO),
        "torch+fsync": _timed(_FsyncTorchIO),
        "goodput": _timed(GoodputCheckpointIO),
    }[method]()
    return io, io, io


METHODS = ["torch", "torch+fsync", "goodput", "torch-async", "goodput-async"]


def run_once(method: str, root: str, args) -> dict:
    io, inner, outer = _plugins(method)
    pl.seed_everything(0, verbose=False)
    model = _Model(args.width, args.layers)
    data = DataLoader(TensorDataset(torch.randn(4, args.width)), batch_size=4)
    ckpts = os.path.join(root, method)
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        plugins=[io],
        callbacks=[ModelCheckpoint(dirpath=ckpts, save_top_k=-1, save_last=False)],
    )
    trainer.fit(model, data)  # its teardown waits for the async saves
    last = os.path.join(ckpts, sorted(os.listdir(ckpts))[-1])
    t = time.perf_counter()
    loaded = io.load_checkpoint(last)
    load_s = time.perf_counter() - t
    assert torch.equal(loaded["state_dict"]["net.0.weight"], model.state_dict()["net.0.weight"])
    shutil.rmtree(ckpts)
    assert len(inner.save_s) == len(outer.save_s) == args.epochs
    return {
        "stall_s": statistics.median(outer.save_s[1:]),
        "save_s": statistics.median(inner.save_s[1:]),
        "load_s": load_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.repeats < 3 or args.epochs < 2:
        ap.error("--repeats must be at least 3 and --epochs at least 2 (the first save is a warm-up)")
    root = tempfile.mkdtemp(prefix="bench-lightning-", dir=args.dir)
    names = list(METHODS)
    results: dict[str, list[dict]] = {m: [] for m in names}
    try:
        for r in range(args.repeats):
            for m in names[r % len(names) :] + names[: r % len(names)]:
                results[m].append(run_once(m, root, args))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    params = args.layers * (args.width * args.width + args.width)
    summary = {
        "checkpoint_mib": round(params * 4 * 3 / 2**20, 1),  # weights + Adam's two moments, fp32
        "repeats": args.repeats,
        **{
            m: {
                k: [round(f(x[k] for x in rs), 3) for f in (min, statistics.median, max)]
                for k in ("stall_s", "save_s", "load_s")
            }
            for m, rs in results.items()
        },
    }
    if args.json:
        print(json.dumps(summary))
        return
    print(
        f"checkpoint about {summary['checkpoint_mib']} MiB of tensors, {args.repeats} repeats (min / median / max, s)"
    )
    for m in names:
        row = "   ".join(
            f"{k[:-2]} " + " / ".join(f"{v:.3f}" for v in summary[m][k]) for k in ("stall_s", "save_s", "load_s")
        )
        print(f"  {m:14s} {row}")


if __name__ == "__main__":
    main()
