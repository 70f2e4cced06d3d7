"""GoodputCheckpointIO with the real Lightning Trainer, on the CPU: a run stopped at an epoch
boundary and resumed with ``ckpt_path="last"`` ends bit-exact with an uninterrupted one (model and
optimizer state), through the plain and the ``AsyncCheckpointIO`` plugin; a damaged file fails the
load with CorruptCheckpointError naming it; removal deletes only what is ours."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from helpers.trees import assert_tree_equal

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from goodput_ckpt import CheckpointError, CorruptCheckpointError  # noqa: E402
from goodput_ckpt.format.manifest import MANIFEST_NAME  # noqa: E402
from goodput_ckpt.integrations.lightning import AsyncGoodputCheckpointIO, GoodputCheckpointIO  # noqa: E402

warnings.filterwarnings("ignore", message=".*does not have many workers.*")


class TinyModel(pl.LightningModule):
    """Two linear layers, Adam (state: step tensors, tuples in param groups) and a StepLR."""

    def __init__(self, hidden: int = 16, betas: tuple = (0.9, 0.999)) -> None:
        super().__init__()
        self.save_hyperparameters()  # the checkpoint then holds hyper_parameters and hparams_name
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2, betas=self.hparams.betas)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=False)


def _fit(
    ckpt_dir: Path, max_epochs: int, plugin, ckpt_path=None, *, loader=None, max_steps=-1, every_n_train_steps=None
) -> tuple[TinyModel, pl.Trainer]:
    pl.seed_everything(0, verbose=False)
    model = TinyModel()
    every = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=1, every_n_train_steps=every_n_train_steps)
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=ckpt_dir.parent,
        callbacks=[every],
        plugins=[plugin],
    )
    trainer.fit(model, (loader or _loader)(), ckpt_path=ckpt_path)  # built after the seed: its sampler draws from it
    return model, trainer


def _state(model: TinyModel, trainer: pl.Trainer) -> dict:
    return {
        "model": model.state_dict(),
        "optim": trainer.optimizers[0].state_dict(),
        "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "step": trainer.global_step,
    }


@pytest.mark.parametrize("make_plugin", [GoodputCheckpointIO, AsyncGoodputCheckpointIO], ids=["sync", "async"])
def test_stopped_and_resumed_run_is_bit_exact(tmp_path, make_plugin):
    whole = _state(*_fit(tmp_path / "whole" / "ckpts", 4, make_plugin()))

    ckpts = tmp_path / "parts" / "ckpts"
    _fit(ckpts, 2, make_plugin())
    last = ckpts / "last.ckpt"
    assert (last / MANIFEST_NAME).is_file()  # a checkpoint location of ours, not a torch.save file
    # save_top_k=1: the plugin removed the older epoch's checkpoint, and kept the newest.
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    resumed = _state(*_fit(ckpts, 4, make_plugin(), ckpt_path="last"))

    assert whole["step"] == resumed["step"] == 16
    assert_tree_equal(whole, resumed, strict=True)


def test_mid_epoch_resume_with_a_stateful_shuffled_loader_is_bit_exact(tmp_path):
    """Lightning keeps a StatefulDataLoader's position (its sampler's generator state is a uint8
    tensor) in the fit loop's state: stopped after 6 of 12 steps (4 batches an epoch), in the
    middle of an epoch, the resumed run sees the same shuffled batches."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader():
        return StatefulDataLoader(_loader().dataset, batch_size=8, shuffle=True)

    run = {"loader": loader, "every_n_train_steps": 2}
    whole = _state(*_fit(tmp_path / "whole" / "ckpts", -1, GoodputCheckpointIO(), max_steps=12, **run))
    ckpts = tmp_path / "parts" / "ckpts"
    _fit(ckpts, -1, GoodputCheckpointIO(), max_steps=6, **run)
    saved = GoodputCheckpointIO().load_checkpoint(ckpts / "last.ckpt")
    assert (saved["epoch"], saved["global_step"]) == (1, 6)  # in the middle of the second epoch
    resumed = _state(*_fit(ckpts, -1, GoodputCheckpointIO(), "last", max_steps=12, **run))
    assert whole["step"] == resumed["step"] == 12
    assert_tree_equal(whole, resumed, strict=True)


def test_lightning_async_wrapper_resumes_bit_exact(tmp_path):
    """Lightning's own AsyncCheckpointIO around ours: saves and resume work (its removals may
    come before the save they remove; see AsyncGoodputCheckpointIO)."""
    whole = _state(*_fit(tmp_path / "whole" / "ckpts", 3, AsyncCheckpointIO(GoodputCheckpointIO())))
    ckpts = tmp_path / "parts" / "ckpts"
    _fit(ckpts, 1, AsyncCheckpointIO(GoodputCheckpointIO()))
    resumed = _state(*_fit(ckpts, 3, AsyncCheckpointIO(GoodputCheckpointIO()), ckpt_path="last"))
    assert_tree_equal(whole, resumed, strict=True)


def test_async_load_and_remove_wait_for_the_saves_before_them(tmp_path):
    io = AsyncGoodputCheckpointIO()
    state = {"w": torch.randn(256, 1024), "epoch": 3}
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    assert io.load_checkpoint(tmp_path / "a.ckpt")["epoch"] == 3  # not CheckpointNotFoundError
    io.save_checkpoint(state, tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "b.ckpt")
    io.teardown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]


def test_checkpoint_dict_round_trips_exactly(tmp_path):
    io = GoodputCheckpointIO()
    _fit(tmp_path / "ckpts", 1, io)
    torch_io = pl.plugins.io.TorchCheckpointIO()
    trainer_dict = io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
    io.save_checkpoint(trainer_dict, tmp_path / "again")
    torch_io.save_checkpoint(trainer_dict, tmp_path / "torch.ckpt")
    assert_tree_equal(
        torch_io.load_checkpoint(tmp_path / "torch.ckpt"), io.load_checkpoint(tmp_path / "again"), strict=True
    )
    # Lightning's own keys are all there, with their Python types.
    assert {
        "epoch",
        "global_step",
        "state_dict",
        "optimizer_states",
        "lr_schedulers",
        "loops",
        "callbacks",
        "hyper_parameters",
        "hparams_name",
    } <= set(trainer_dict)
    assert trainer_dict["hyper_parameters"] == {"hidden": 16, "betas": (0.9, 0.999)}
    assert type(trainer_dict["optimizer_states"][0]["param_groups"][0]["betas"]) is tuple


def test_damaged_file_fails_the_resume_naming_it(tmp_path):
    ckpts = tmp_path / "ckpts"
    _fit(ckpts, 1, GoodputCheckpointIO())
    data = sorted((ckpts / "last.ckpt").glob("*.bin"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=data.name):
        GoodputCheckpointIO().load_checkpoint(ckpts / "last.ckpt")
    with pytest.raises(CorruptCheckpointError, match=data.name):
        _fit(ckpts, 2, GoodputCheckpointIO(), ckpt_path="last")


def test_remove_deletes_only_our_checkpoint(tmp_path):
    io = GoodputCheckpointIO()
    io.save_checkpoint({"w": torch.ones(3), "epoch": 1}, tmp_path / "ours.ckpt")
    io.remove_checkpoint(tmp_path / "ours.ckpt")
    assert not (tmp_path / "ours.ckpt").exists()

    foreign = tmp_path / "foreign.ckpt"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint")
    io.remove_checkpoint(foreign)
    assert (foreign / "notes.txt").read_text() == "not a checkpoint"

    # A stray file beside our checkpoint is not ours: it stays, and so does its directory.
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "mixed.ckpt")
    (tmp_path / "mixed.ckpt" / "notes.txt").write_text("keep me")
    io.remove_checkpoint(tmp_path / "mixed.ckpt")
    assert sorted(p.name for p in (tmp_path / "mixed.ckpt").iterdir()) == ["notes.txt"]


def test_another_plugins_file_is_named_and_left_alone(tmp_path):
    """A torch.save file from Lightning's default plugin (a directory reused after a switch)."""
    path = tmp_path / "epoch=0-step=4.ckpt"
    pl.plugins.io.TorchCheckpointIO().save_checkpoint({"w": torch.ones(1)}, path)
    with pytest.raises(CheckpointError, match="TorchCheckpointIO"):
        GoodputCheckpointIO().load_checkpoint(path)
    GoodputCheckpointIO().remove_checkpoint(path)
    assert path.is_file()


def test_map_location_and_storage_options(tmp_path):
    io = GoodputCheckpointIO()
    io.save_checkpoint({"w": torch.arange(4.0)}, tmp_path / "a.ckpt", storage_options={"volume": False})
    assert io.load_checkpoint(tmp_path / "a.ckpt", map_location="cpu")["w"].device.type == "cpu"
    assert io.load_checkpoint(tmp_path / "a.ckpt", map_location={"cpu": "cpu"})["w"].tolist() == [0, 1, 2, 3]
    with pytest.raises(TypeError, match="map_location"):
        io.load_checkpoint(tmp_path / "a.ckpt", map_location=lambda s, loc: s)
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "b.ckpt", storage_options="fast")


def test_s3_save_load_and_remove(tmp_path, moto):
    """A Lightning checkpoint dict to s3:// and back (a real S3 server on 127.0.0.1), and its removal."""
    _fit(tmp_path / "ckpts", 1, GoodputCheckpointIO())
    trainer_dict = GoodputCheckpointIO().load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
    io = GoodputCheckpointIO(**moto.options())
    uri = moto.uri("run/epoch=0-step=4.ckpt")
    io.save_checkpoint(trainer_dict, uri)
    assert f"run/epoch=0-step=4.ckpt/{MANIFEST_NAME}" in moto.keys("run/")
    assert_tree_equal(trainer_dict, io.load_checkpoint(uri), strict=True)
    io.remove_checkpoint(uri)
    assert moto.keys("run/") == []
