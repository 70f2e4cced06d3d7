"""goodput-ckpt's Accelerate save_state/load_state with a real Accelerator on the CPU: a loop
stopped in the middle of an epoch (a shuffled stateful dataloader, dropout, a scheduler, a
registered object) and resumed in freshly built objects ends bit-exact with an uninterrupted one;
on S3 too; a checkpoint that does not match the prepared objects is refused by name."""

from __future__ import annotations

import pytest
import torch
from helpers.trees import assert_tree_equal

pytest.importorskip("accelerate")
pytest.importorskip("torchdata")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402

from goodput_ckpt import CheckpointError, CorruptCheckpointError  # noqa: E402
from goodput_ckpt.format.manifest import MANIFEST_NAME  # noqa: E402
from goodput_ckpt.integrations.accelerate import load_state, save_state  # noqa: E402

STEPS = 12  # 8 batches an epoch: a stop at 6 is in the middle of the first


class Counter:
    """An object registered with ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


class Run:
    """A fresh Accelerator and freshly built, prepared objects (seeded with ``seed``: a resume
    must overwrite all of them)."""

    def __init__(self, seed: int = 0) -> None:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        self.acc = Accelerator(
            cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)
        )
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
            batch_size=4,
            shuffle=True,
            generator=torch.Generator().manual_seed(2),
        )
        self.model, self.opt, self.sched, self.loader = self.acc.prepare(model, opt, sched, loader)
        self.counter = Counter()
        self.acc.register_for_checkpointing(self.counter)
        self.step = 0

    def train(self, until: int) -> Run:
        while self.step < until:
            for x, y in self.loader:
                loss = torch.nn.functional.mse_loss(self.model(x), y)
                self.acc.backward(loss)
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad()
                self.step += 1
                self.counter.seen += len(x)
                if self.step == until:
                    break
        return self

    def state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "opt": self.opt.state_dict(),
            "sched": self.sched.state_dict(),
            "seen": self.counter.seen,
            "rng": torch.get_rng_state(),
        }


@pytest.fixture(scope="module")
def whole():
    return Run().train(STEPS).state()


def test_stopped_and_resumed_loop_is_bit_exact(tmp_path, whole):
    first = Run().train(6)
    save_state(first.acc, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / MANIFEST_NAME).is_file()
    del first
    resumed = Run(seed=123)
    load_state(resumed.acc, tmp_path / "ckpt")
    resumed.step = 6
    assert_tree_equal(whole, resumed.train(STEPS).state(), strict=True)


def test_s3_round_trip_is_bit_exact(moto, whole):
    first = Run().train(6)
    uri = moto.uri("acc/step-6")
    save_state(first.acc, uri, **moto.options())
    resumed = Run(seed=123)
    load_state(resumed.acc, uri, **moto.options())
    resumed.step = 6
    assert_tree_equal(whole, resumed.train(STEPS).state(), strict=True)


def test_a_mismatched_set_of_objects_is_refused(tmp_path):
    first = Run().train(2)
    save_state(first.acc, tmp_path / "ckpt")
    other = Run()
    other.acc.register_for_checkpointing(Counter())  # two registered objects, one saved
    with pytest.raises(CheckpointError, match="1 custom and the Accelerator has 2"):
        load_state(other.acc, tmp_path / "ckpt")


def test_damaged_file_is_named(tmp_path):
    first = Run().train(2)
    save_state(first.acc, tmp_path / "ckpt")
    data = sorted((tmp_path / "ckpt").glob("*.bin"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=data.name):
        load_state(Run().acc, tmp_path / "ckpt")


def test_a_model_that_does_not_fit_is_refused_by_name(tmp_path):
    first = Run().train(2)
    save_state(first.acc, tmp_path / "ckpt")
    other = Run()
    other.acc._models[0].add_module("extra", torch.nn.Linear(2, 2))  # keys the checkpoint lacks
    with pytest.raises(CheckpointError, match="saved model 0 state does not fit"):
        load_state(other.acc, tmp_path / "ckpt")
