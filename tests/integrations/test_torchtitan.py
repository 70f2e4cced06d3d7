"""GoodputCheckpointManager with torchtitan's real CheckpointManager, optimizer and LR scheduler
containers, on the CPU (a one-rank gloo group, in a spawned process so that no process group
leaks into other tests): a run stopped after step 7 (checkpoints at 3 and 6) and resumed with
``load()`` ends bit-exact with an uninterrupted one (saved with ``async_mode="async"``); a half-written newest step is skipped; a
damaged file fails the load naming it. Skipped when torchtitan is not installed (it is not in the
test extra: docs/integrations.md says why)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torchtitan")

from helpers.dist import run_ranks  # noqa: E402

pytestmark = pytest.mark.multiproc

STEPS = 12


def _build(folder: str, cls, async_mode: str = "disabled"):
    import torch
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]
    opts = OptimizersContainer.Config(param_groups=groups, implementation="for-loop").build(model_parts=[model])
    scheds = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opts, training_steps=STEPS)
    cfg = cls.Config(
        enable=True, folder="ckpt", interval=3, keep_latest_k=2, last_save_model_only=False, async_mode=async_mode
    )
    mgr = cfg.build(
        dataloader=None,
        model_parts=[model],
        optimizers=opts,
        lr_schedulers=scheds,
        states={},
        sd_adapter=None,
        base_folder=folder,
    )
    return model, opts, scheds, mgr


def _train(parts, start: int, end: int) -> None:
    import torch

    model, opts, scheds, mgr = parts
    xs = torch.randn(STEPS, 4, 8, generator=torch.Generator().manual_seed(1))
    for step in range(start + 1, end + 1):
        x = xs[step - 1]
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opts.step()
        scheds.step()
        opts.zero_grad()
        mgr.save(step, last_step=step == STEPS)


def _state(parts) -> dict:
    model, opts, scheds, _ = parts
    return {"model": model.state_dict(), "optim": opts.state_dict(), "sched": scheds.state_dict()}


def _resume_checks(rank: int, world_size: int, root: str) -> None:
    from helpers.trees import assert_tree_equal

    from goodput_ckpt import CorruptCheckpointError
    from goodput_ckpt.format.manifest import MANIFEST_NAME
    from goodput_ckpt.integrations.torchtitan import GoodputCheckpointManager as Mgr

    whole = _build(f"{root}/whole", Mgr, async_mode="async")  # dcp.async_save with our writer
    _train(whole, 0, STEPS)
    whole[3].maybe_wait_for_saving()
    expected = _state(whole)
    whole[3].close()
    # (keep_latest_k purges only the step folders it lists; an async save's folder may not exist yet)
    assert all(os.path.isfile(f"{root}/whole/ckpt/{s}/{MANIFEST_NAME}") for s in ("step-9", "step-12"))

    first = _build(f"{root}/parts", Mgr)
    _train(first, 0, 7)
    first[3].close()
    ckpt = f"{root}/parts/ckpt"
    assert sorted(os.listdir(ckpt)) == ["step-3", "step-6"], os.listdir(ckpt)
    assert MANIFEST_NAME in os.listdir(f"{ckpt}/step-6") and ".metadata" not in os.listdir(f"{ckpt}/step-6")

    resumed = _build(f"{root}/parts", Mgr)
    assert resumed[3].load()
    _train(resumed, 6, STEPS)
    assert_tree_equal(expected, _state(resumed), strict=True)
    resumed[3].close()

    # A half-written newest step (no commit record) is skipped, as torchtitan's own search skips
    # a step without DCP's .metadata.
    os.remove(f"{ckpt}/step-12/{MANIFEST_NAME}")
    again = _build(f"{root}/parts", Mgr)
    assert again[3]._find_load_step() == 9
    again[3].close()

    # A damaged file fails the load, named.
    data = sorted(f for f in os.listdir(f"{ckpt}/step-9") if f.endswith(".bin"))[0]
    with open(f"{ckpt}/step-9/{data}", "r+b") as f:
        f.seek(os.path.getsize(f"{ckpt}/step-9/{data}") // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    broken = _build(f"{root}/parts", Mgr)
    try:
        broken[3].load()
    except CorruptCheckpointError as e:
        assert data in str(e), e
    else:
        raise AssertionError("a damaged file loaded")
    finally:
        broken[3].close()


def test_stopped_and_resumed_run_is_bit_exact(tmp_path):
    run_ranks(_resume_checks, 1, str(tmp_path), report_dir=tmp_path / "report", timeout=300)
