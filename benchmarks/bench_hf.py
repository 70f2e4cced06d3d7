"""The Hugging Face Trainer's own checkpoints against GoodputTrainer's, on the same training run.

Each method trains the same model (seeded; a stack of ``--layers`` square linear layers of width
``--width``, AdamW, so the checkpoint holds the model and two optimizer moments) with a real
``transformers.Trainer`` on the CPU for ``--saves`` steps, saving after every step
(``save_steps=1``). Timed per save: the *stall*, the time the training loop spends in the
Trainer's ``_save_checkpoint`` (both methods save synchronously, so this is also the save time).
The last checkpoint is then read back once (timed): for the Trainer's own format what its resume
reads (``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``,
``trainer_state.json``), for ours ``load_tree`` (every chunk verified).

Methods:
- ``trainer``: the stock ``Trainer`` (safetensors for the model, ``torch.save`` for the rest, no
  fsync: the files may sit in the page cache when the save returns);
- ``trainer+fsync``: the same, then every file of the checkpoint fsynced (durable, as ours is);
- ``goodput``: ``GoodputTrainer`` (raw bytes hashed with blake3, every file fsynced, the manifest
  committed last).

Rules: the first save of each run is a warm-up (the machine hands back memory that sat free, and
the first touch of it is slow: docs/benchmarks.md, Noise) and is not counted; each repeat runs
the methods in an order rotated by one, and deletes its files afterwards. Printed: min, median and
max over the repeats of each run's median save time, and the load time likewise; and per repeat
the stock Trainer's time over each other method's (above 1: faster), min / median / max. The
rotation, summary and ratios are ``benchmarks/_plugin_bench.py``'s, shared with
``bench_lightning.py``.

    python benchmarks/bench_hf.py --repeats 5
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import time
import warnings

import _plugin_bench
import torch
from safetensors.torch import load_file
from transformers import PrinterCallback, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

from goodput_ckpt.integrations._tree import load_tree
from goodput_ckpt.integrations.transformers import GoodputTrainer

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
logging.getLogger("goodput_ckpt").setLevel(logging.ERROR)


class _Model(torch.nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x, labels=None):
        return {"loss": self.net(x).pow(2).mean()}


class _Data(torch.utils.data.Dataset):
    def __init__(self, width: int) -> None:
        self.x = torch.randn(4, width, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i]}


def _timed(base: type, fsync: bool = False) -> type:
    class Timed(base):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            self.save_s: list[float] = []

        def _save_checkpoint(self, model, trial):
            t = time.perf_counter()
            super()._save_checkpoint(model, trial)
            if fsync:
                folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
                for name in os.listdir(folder):
                    fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            self.save_s.append(time.perf_counter() - t)

    return Timed


METHODS = {"trainer": _timed(Trainer), "trainer+fsync": _timed(Trainer, fsync=True), "goodput": _timed(GoodputTrainer)}


def _load_stock(folder: str) -> torch.Tensor:
    model = load_file(os.path.join(folder, "model.safetensors"))
    torch.load(os.path.join(folder, "optimizer.pt"), weights_only=True)
    torch.load(os.path.join(folder, "scheduler.pt"), weights_only=True)
    torch.load(
        os.path.join(folder, "rng_state.pth"), weights_only=False
    )  # numpy state: as the Trainer's safe_globals allow
    with open(os.path.join(folder, "trainer_state.json")) as f:
        json.load(f)
    return model["net.0.weight"]


def run_once(method: str, root: str, args) -> dict:
    out = os.path.join(root, method)
    targs = TrainingArguments(
        output_dir=out,
        max_steps=args.saves,
        save_steps=1,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
        seed=0,
        learning_rate=1e-4,
    )
    torch.manual_seed(0)
    trainer = METHODS[method](model=_Model(args.width, args.layers), args=targs, train_dataset=_Data(args.width))
    trainer.remove_callback(PrinterCallback)  # its per-run metrics line
    trainer.train()
    last = os.path.join(out, f"checkpoint-{args.saves}")
    t = time.perf_counter()
    weight = load_tree(last)["model"]["net.0.weight"] if method == "goodput" else _load_stock(last)
    load_s = time.perf_counter() - t
    assert torch.equal(weight, trainer.model.state_dict()["net.0.weight"])
    shutil.rmtree(out)
    assert len(trainer.save_s) == args.saves
    return {"stall_s": statistics.median(trainer.save_s[1:]), "load_s": load_s}


def main() -> None:
    _plugin_bench.main(
        __doc__,
        list(METHODS),
        run_once,
        keys=("stall_s", "load_s"),
        baseline_of={"trainer+fsync": "trainer", "goodput": "trainer"},
        steps_flag="--saves",
        prefix="bench-hf-",
    )


if __name__ == "__main__":
    main()
