"""GoodputTrainer with the real transformers Trainer, on the CPU: a run stopped in the middle of an
epoch (shuffled sampler, dropout) and resumed with ``train(resume_from_checkpoint=True)`` ends
bit-exact with an uninterrupted one (model, optimizer, scheduler, step, RNG), on local disk and on
S3; a half-written newest checkpoint is skipped; a damaged file fails the resume naming it;
``save_total_limit`` removes only our committed checkpoints; a stock Trainer checkpoint still
resumes."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from helpers.trees import assert_tree_equal

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from goodput_ckpt import CheckpointError, CorruptCheckpointError  # noqa: E402
from goodput_ckpt.format.manifest import MANIFEST_NAME  # noqa: E402
from goodput_ckpt.integrations._tree import load_tree, save_tree  # noqa: E402
from goodput_ckpt.integrations.transformers import GoodputTrainer  # noqa: E402

warnings.filterwarnings("ignore", message=".*pin_memory.*")

STEPS = 12  # 8 batches an epoch: a stop at step 6 is in the middle of the first epoch


class TinyNet(torch.nn.Module):
    """Two linear layers with dropout (so the resumed RNG matters), returning the loss as the
    Trainer expects from a model."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.drop, self.l2 = torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)

    def forward(self, x, labels=None):
        out = self.l2(self.drop(torch.tanh(self.l1(x))))
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.x[i].sum(0, keepdim=True)}


class StopAt(TrainerCallback):
    """Stops training after ``step`` (the run is killed there, as far as the checkpoint sees)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _train(
    out: Path, *, stop=None, resume=None, trainer_cls=GoodputTrainer, save_total_limit=None, callbacks=(), **extra
):
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        save_steps=3,
        seed=0,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
        lr_scheduler_type="linear",
        warmup_steps=2,
        learning_rate=1e-2,
        dataloader_num_workers=0,
        save_total_limit=save_total_limit,
    )
    torch.manual_seed(0)
    trainer = trainer_cls(
        model=TinyNet(),
        args=args,
        train_dataset=Data(),
        callbacks=[*callbacks, *([StopAt(stop)] if stop else [])],
        **extra,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _state(trainer) -> dict:
    return {
        "model": trainer.model.state_dict(),
        "optim": trainer.optimizer.state_dict(),
        "sched": trainer.lr_scheduler.state_dict(),
        "step": trainer.state.global_step,
        "rng": torch.get_rng_state(),
    }


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run's end state (the same for every resume below)."""
    return _state(_train(tmp_path_factory.mktemp("whole")))


def test_stopped_and_resumed_run_is_bit_exact(tmp_path, whole):
    _train(tmp_path, stop=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-6"]
    files = sorted(p.name for p in (tmp_path / "checkpoint-6").iterdir())
    assert MANIFEST_NAME in files and all(
        f == MANIFEST_NAME or f.endswith(".bin") for f in files
    )  # no torch.save files
    resumed = _train(tmp_path, resume=True)
    assert resumed.state.global_step == whole["step"] == STEPS
    assert_tree_equal(whole, _state(resumed), strict=True)


def test_a_half_written_newest_checkpoint_is_skipped(tmp_path, whole):
    """A save killed before its commit record: the resume takes the newest committed one (step
    3) and still ends bit-exact; the Trainer's own search would take checkpoint-6."""
    _train(tmp_path, stop=6)
    (tmp_path / "checkpoint-6" / MANIFEST_NAME).unlink()
    resumed = _train(tmp_path, resume=True)
    assert_tree_equal(whole, _state(resumed), strict=True)


def test_a_stock_trainer_checkpoint_still_resumes(tmp_path, whole):
    """Switching formats mid-run: the stock Trainer's checkpoint-6 goes to its own loader, and
    the run continues (saving in our format) bit-exact."""
    _train(tmp_path, stop=6, trainer_cls=Trainer)
    resumed = _train(tmp_path, resume=True)
    assert_tree_equal(whole, _state(resumed), strict=True)
    assert (tmp_path / "checkpoint-12" / MANIFEST_NAME).is_file()


def test_damaged_file_fails_the_resume_naming_it(tmp_path):
    _train(tmp_path, stop=3)
    data = sorted((tmp_path / "checkpoint-3").glob("*.bin"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=data.name):
        _train(tmp_path, resume=True)
    with pytest.raises(CorruptCheckpointError, match=data.name):
        _train(tmp_path, resume=str(tmp_path / "checkpoint-3"))


def test_save_total_limit_removes_only_our_committed_checkpoints(tmp_path):
    foreign = tmp_path / "checkpoint-1"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not ours")
    _train(tmp_path, stop=9, save_total_limit=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-9"]
    assert (foreign / "notes.txt").read_text() == "not ours"


def test_a_checkpoint_of_something_else_is_refused(tmp_path):
    save_tree({"w": torch.ones(2), "epoch": 1}, tmp_path / "other")
    with pytest.raises(CheckpointError, match="not of a transformers.Trainer"):
        _train(tmp_path / "out", resume=str(tmp_path / "other"))


def test_s3_stop_and_resume_is_bit_exact(tmp_path, moto, whole):
    """Checkpoints on S3 (a real server on 127.0.0.1); the Trainer's output_dir stays local."""
    root = moto.uri("run")
    _train(tmp_path, stop=6, checkpoint_root=root, checkpoint_options=moto.options(), save_total_limit=1)
    assert sorted({k.split("/")[1] for k in moto.keys("run/")}) == ["checkpoint-6"]
    assert not list(tmp_path.glob("checkpoint-*"))
    resumed = _train(tmp_path, resume=True, checkpoint_root=root, checkpoint_options=moto.options())
    assert_tree_equal(whole, _state(resumed), strict=True)


def test_load_best_model_at_end_reads_our_checkpoint(tmp_path):
    """``load_best_model_at_end``: the best checkpoint survives ``save_total_limit`` and its
    weights are loaded from our format at the end. (With ``save_total_limit=1`` the Trainer's
    own ``_finalize_training`` then deletes every other local ``checkpoint-*`` directory.)"""
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=9,
        save_steps=3,
        eval_strategy="steps",
        eval_steps=3,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,  # the worst: an early one
        save_total_limit=1,
        seed=0,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        learning_rate=1e-2,
    )
    torch.manual_seed(0)
    trainer = GoodputTrainer(model=TinyNet(), args=args, train_dataset=Data(), eval_dataset=Data(8))
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and Path(best, MANIFEST_NAME).is_file()
    assert Path(best).name != "checkpoint-9"  # kept by the rotation at step 9, though older
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(best).name]
    assert_tree_equal(load_tree(best)["model"], trainer.model.state_dict(), strict=True)


class SeedPerRank(TrainerCallback):
    """Gives each process its own torch RNG stream at the start of training (before a resume
    restores the saved one), so that a process handed another's state would diverge."""

    def on_train_begin(self, args, state, control, **kwargs):
        torch.manual_seed(100 + args.process_index)


def _ddp_checks(rank: int, world_size: int, root: str) -> None:
    import os

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
    )

    def run(out, stop=None, resume=None):
        return _train(Path(out), stop=stop, resume=resume, callbacks=[SeedPerRank()])

    whole = _state(run(f"{root}/whole"))
    run(f"{root}/parts", stop=6)
    if rank == 0:
        from goodput_ckpt.integrations._tree import load_tree as _load

        rngs = _load(f"{root}/parts/checkpoint-6")["rng"]
        assert len(rngs) == world_size and not torch.equal(rngs[0]["torch"], rngs[1]["torch"])
    resumed = _state(run(f"{root}/parts", resume=True))
    assert_tree_equal(whole, resumed, strict=True)


@pytest.mark.multiproc
@pytest.mark.slow  # 2 processes that import transformers and train three runs: 1.5 minutes on the shared machine
def test_two_process_ddp_run_resumes_bit_exact(tmp_path):
    """Two CPU processes (DDP over gloo): the main process gathers both processes' RNG states
    into the checkpoint, each takes its own back on resume, and both end bit-exact."""
    from helpers.dist import run_ranks

    run_ranks(_ddp_checks, 2, str(tmp_path), report_dir=tmp_path / "report", timeout=480)


def test_a_model_that_does_not_fit_is_refused_by_name(tmp_path):
    _train(tmp_path, stop=3)

    class Wider(TinyNet):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = torch.nn.Linear(8, 32), torch.nn.Linear(32, 1)

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, save_steps=3, use_cpu=True, report_to=[])
    trainer = GoodputTrainer(model=Wider(), args=args, train_dataset=Data())
    with pytest.raises(CheckpointError, match="saved model state does not fit"):
        trainer.train(resume_from_checkpoint=True)


def test_a_trainer_state_with_unknown_fields_is_refused(tmp_path):
    from goodput_ckpt.integrations.transformers import CHECKPOINT_KIND

    tree = {
        "kind": CHECKPOINT_KIND,
        "version": 1,
        "model": TinyNet().state_dict(),
        "trainer_state": {"global_step": 3, "bogus": 1},
    }
    save_tree(tree, tmp_path / "checkpoint-3")
    with pytest.raises(CheckpointError, match="does not know: \\['bogus'\\]"):
        _train(tmp_path, resume=True)
