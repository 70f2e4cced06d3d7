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
max over the repeats of each run's median save time, and the load time likewise; and per repeat
Lightning's stock plugin's time over ours (``torch`` for the blocking methods, ``torch-async`` for
``goodput-async``; above 1: ours is faster), min / median / max. The rotation, summary and ratios
are ``benchmarks/_plugin_bench.py``'s, shared with ``bench_hf.py``.

    python benchmarks/bench_lightning.py --repeats 3
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import time
import warnings

import _plugin_bench
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
    _plugin_bench.main(
        __doc__,
        METHODS,
        run_once,
        keys=("stall_s", "save_s", "load_s"),
        # each against Lightning's stock plugin of the same kind: blocking or async
        baseline_of={"torch+fsync": "torch", "goodput": "torch", "goodput-async": "torch-async"},
        steps_flag="--epochs",
        prefix="bench-lightning-",
    )


if __name__ == "__main__":
    main()
