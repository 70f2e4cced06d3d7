"""CheckpointManager(incremental=...): a LoRA job's saves write the adapters and reference the
frozen base; retention keeps a referenced step; a killed job restores bit-exactly
(manager/incremental_saves.py, manager/step_references.py)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers.lora import adapter_optimizer, frozen_bytes, lora_model, train_step
from helpers.trees import assert_tree_equal

from goodput_ckpt import CheckpointManager
from goodput_ckpt.format.manifest import parse_manifest
from goodput_ckpt.manager.step_layout import step_dir_name
from goodput_ckpt.tools import verify_checkpoint

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "incremental_job.py")


def _saves(root) -> dict[int, dict]:
    with open(os.path.join(root, "goodput-timeline.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if r["event"] == "save" and r["ok"]}


def _steps_on_disk(root) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_"))


def test_retention_keeps_a_referenced_base_and_deletes_it_after(tmp_path):
    """keep_last=2 over 6 saves, a full save every 4th: steps 2-4 reference step 1, which
    survives until no kept step references it; every kept step verifies and restores."""
    root = str(tmp_path / "root")
    model = lora_model(layers=2)
    opt = adapter_optimizer(model)
    mgr = CheckpointManager(root, keep_last=2, incremental=4, async_save=False)
    on_disk = {}
    for step in range(1, 7):
        train_step(model, opt, step)
        mgr.save(step, model=model, optimizer=opt)
        on_disk[step] = _steps_on_disk(root)
        for s in mgr.steps():
            assert verify_checkpoint(os.path.join(root, step_dir_name(s))).ok, (step, s)
    mgr.close()
    # Steps 2, 3, 4 reference step 1; 5 is full, 6 references 5.
    assert on_disk[3] == [1, 2, 3] and on_disk[4] == [1, 3, 4] and on_disk[5] == [1, 4, 5]
    assert on_disk[6] == [5, 6]
    fresh, fresh_opt = lora_model(layers=2, seed=5), None
    fresh_opt = adapter_optimizer(fresh)
    again = CheckpointManager(root, keep_last=2, incremental=4)
    assert again.restore(model=fresh, optimizer=fresh_opt) == 6
    again.close()
    assert_tree_equal(fresh.state_dict(), model.state_dict())
    assert_tree_equal(fresh_opt.state_dict(), opt.state_dict())


def test_a_damaged_kept_step_protects_every_older_step(tmp_path):
    """A kept step whose record cannot be read may reference anything older: nothing older goes."""
    root = str(tmp_path / "root")
    model = lora_model(layers=1)
    opt = adapter_optimizer(model)
    mgr = CheckpointManager(root, keep_last=2, async_save=False)
    for step in (1, 2):
        train_step(model, opt, step)
        mgr.save(step, model=model, optimizer=opt)
    with open(os.path.join(root, step_dir_name(2), "manifest.json"), "r+b") as f:
        f.seek(40)
        f.write(b"#")  # damaged: its references cannot be known
    train_step(model, opt, 3)
    mgr.save(3, model=model, optimizer=opt)  # keep_last=2 keeps 2 and 3; 1 would go
    mgr.close()
    assert _steps_on_disk(root) == [1, 2, 3]


def test_a_killed_lora_job_restores_bit_exactly_and_wrote_only_the_adapters(tmp_path):
    root = str(tmp_path / "root")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(JOB)), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run([sys.executable, JOB, root, "6"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-3000:]
    saves = _saves(root)
    model = lora_model()
    opt = adapter_optimizer(model)
    mgr = CheckpointManager(root, keep_last=2, incremental=3)
    step = mgr.restore(model=model, optimizer=opt)
    mgr.close()
    assert step in (5, 6)
    expected = torch.load(str(tmp_path / f"expected_{step}.pt"), weights_only=True)
    assert_tree_equal(model.state_dict(), expected["model"])
    assert_tree_equal(opt.state_dict(), expected["optim"])
    # Bytes per save, from the writer's counters (the timeline): full saves at 1 and 4, the
    # others write the adapters, optimizer, RNG and metadata only.
    frozen = frozen_bytes(model)
    trainable_state = saves[1]["written_bytes"] - frozen  # what a full save writes besides the base
    for s in (2, 3, 5):
        assert saves[s]["referenced_bytes"] == frozen, s
        assert saves[s]["written_bytes"] <= 1.1 * trainable_state, (s, saves[s]["written_bytes"], trainable_state)
    assert saves[4]["referenced_bytes"] == 0 and saves[4]["written_bytes"] > frozen


def test_ls_inspect_verify_reshard_and_convert_of_an_incremental_step(tmp_path):
    """The tools show what a step wrote and what it references; reshard and convert read the
    references and write a standalone checkpoint."""
    from goodput_ckpt.format.manifest import parse_manifest
    from goodput_ckpt.tools import convert_checkpoint, inspect_checkpoint, list_checkpoints, reshard_checkpoint

    root = str(tmp_path / "root")
    model = lora_model(layers=2)
    opt = adapter_optimizer(model)
    mgr = CheckpointManager(root, keep_last=None, incremental=True, async_save=False)
    for step in (1, 2):
        train_step(model, opt, step)
        mgr.save(step, model=model, optimizer=opt)
    mgr.close()
    frozen = frozen_bytes(model)
    rows = {c.step: c for c in list_checkpoints(root, verify=True).checkpoints}
    base_files = [p for p in os.scandir(os.path.join(root, step_dir_name(1))) if p.name.endswith(".bin")]
    assert rows[1].referenced == 0 and rows[2].referenced == sum(p.stat().st_size for p in base_files)
    assert rows[2].status == "complete" and rows[2].bytes < rows[1].bytes - frozen // 2
    step2 = os.path.join(root, step_dir_name(2))
    report = inspect_checkpoint(step2)
    assert report.referenced_bytes == rows[2].referenced and report.bases == [step_dir_name(1)] and not report.problems
    for out in (tmp_path / "resharded", tmp_path / "converted"):
        if out.name == "resharded":
            reshard_checkpoint(step2, str(out), world_size=1)
        else:
            convert_checkpoint(step2, str(out), to="goodput")
        with open(out / "manifest.json", "rb") as f:
            assert parse_manifest(f.read()).bases() == set()  # standalone
        fresh = lora_model(layers=2, seed=3)
        fresh_opt = adapter_optimizer(fresh)
        import shutil

        shutil.rmtree(tmp_path / "copy", ignore_errors=True)
        copy = tmp_path / "copy" / step_dir_name(2)
        shutil.copytree(out, copy)
        again = CheckpointManager(str(tmp_path / "copy"))
        assert again.restore(model=fresh, optimizer=fresh_opt) == 2
        again.close()
        assert_tree_equal(fresh.state_dict(), model.state_dict())


@pytest.mark.parametrize("value", [0, -1, 1.5, "yes"])
def test_incremental_takes_a_bool_or_a_positive_count(tmp_path, value):
    with pytest.raises(ValueError, match="incremental"):
        CheckpointManager(str(tmp_path), incremental=value)


def test_two_tiers_in_one_process_persist_the_bases_first_and_restore_from_each_tier(tmp_path):
    """One process, two tiers: a persisted incremental step whose base was not due for the
    persistent tier gets that base persisted first, and only what it lacks; retention on both
    tiers keeps the bases of kept steps; the newest step restores bit-exact from the local tier,
    and with the local tier lost, the newest persisted one from the persistent tier alone (the
    multi-rank cases, replicas included: test_incremental_tiers.py)."""
    torch.manual_seed(0)
    model = lora_model()
    opt = adapter_optimizer(model)
    root, local = tmp_path / "root", tmp_path / "local"
    expected = {}
    opts = dict(local_dir=str(local), persist_every=3, keep_last=1, incremental=4, timeline=False)
    with CheckpointManager(str(root), **opts) as mgr:
        for step in range(1, 7):
            train_step(model, opt, step)
            mgr.save(step, model=model, optimizer=opt)
            mgr.wait()
            expected[step] = copy.deepcopy(model.state_dict())
        tiers = mgr.step_tiers()
    # Saves 1 and 5 are full. Steps 3 and 6 were due for the persistent tier; 3 references 1,
    # which went first; keep_last=1 there keeps 6 and what it references (5), not 1 or 3.
    persisted = sorted(p.name for p in root.glob("step_*"))
    assert persisted == [step_dir_name(5), step_dir_name(6)], persisted
    with open(root / step_dir_name(6) / "manifest.json", "rb") as f:
        assert parse_manifest(f.read()).bases() == {step_dir_name(5)}
    assert tiers[6] == ("local", "persistent") and tiers[5] == ("local", "persistent"), tiers
    for name in persisted:
        assert verify_checkpoint(str(root / name)).ok, name
    fresh = lora_model(seed=7)
    fresh_opt = adapter_optimizer(fresh)
    with CheckpointManager(str(root), **opts) as mgr:
        assert mgr.restore(model=fresh, optimizer=fresh_opt) == 6
    assert_tree_equal(fresh.state_dict(), expected[6])
    shutil.rmtree(local)  # the node's disk is gone: the persistent tier alone
    fresh = lora_model(seed=8)
    fresh_opt = adapter_optimizer(fresh)
    with CheckpointManager(str(root), **opts) as mgr:
        assert mgr.restore(model=fresh, optimizer=fresh_opt) == 6
        assert mgr.timeline[-1]["sources"] == {"persistent": 2}  # its own file and the one in its base
    assert_tree_equal(fresh.state_dict(), expected[6])


def test_incremental_saves_refuse_overwrite(tmp_path):
    """Overwriting a step deletes its files first: a kept step may reference them."""
    with pytest.raises(ValueError, match="overwrite"):
        CheckpointManager(str(tmp_path), incremental=True, overwrite=True)
