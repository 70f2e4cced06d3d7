"""inspect_checkpoint: version, step, world size, sections, totals, item table, key globs."""

from __future__ import annotations

import pytest
from helpers.samples import damaged_manifests, flat_tensors, item_range, save, truncate

from goodput_ckpt import CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError
from goodput_ckpt.format import MANIFEST_NAME
from goodput_ckpt.format.manifest import FORMAT_VERSION
from goodput_ckpt.tools.ops.inspect import TRAINING_STATE_KEY, inspect_checkpoint, section_of


def test_report_covers_the_whole_checkpoint(sample_ckpt):
    path, sd = sample_ckpt
    r = inspect_checkpoint(str(path))
    tensors = flat_tensors(sd)
    assert (r.format, r.version, r.world_size, r.step) == ("goodput-ckpt", FORMAT_VERSION, 1, 100)
    assert r.tensors == len(tensors)
    assert r.tensor_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert r.objects == 5  # optimizer lr, betas, params (DCP flattens param_groups) + extra name, epoch
    assert [s.name for s in r.sections] == ["model", "optimizer", "rng", "dataloader", "extra"]
    model = next(s for s in r.sections if s.name == "model")
    assert model.tensors == len(sd["model"]) and model.objects == 0
    rows = {i.key: i for i in r.items}
    emb = rows["model.embed.weight"]
    assert (emb.kind, emb.dtype, emb.shape, emb.shards, emb.bytes) == (
        "tensor",
        "float32",
        [1001, 64],
        1,
        1001 * 64 * 4,
    )
    assert rows["model.scale"].shape == [] and rows["model.f8"].dtype == "float8_e4m3fn"
    assert rows["extra.name"].kind == "object" and rows["extra.name"].dtype is None
    assert sum(s.bytes for s in r.sections) == r.tensor_bytes + r.object_bytes
    assert r.file_bytes >= r.tensor_bytes and not r.problems


def test_key_glob_filters_rows_not_totals(sample_ckpt):
    path, _ = sample_ckpt
    r = inspect_checkpoint(str(path), pattern="model.*.weight")
    assert sorted(i.key for i in r.items) == ["model.embed.weight", "model.head.weight", "model.layer.weight"]
    full = inspect_checkpoint(str(path))
    assert r.tensors == full.tensors and r.sections == full.sections
    r = inspect_checkpoint(str(path), pattern=["rng.*", "dataloader.*"])
    assert {i.section for i in r.items} == {"rng", "dataloader"}
    assert inspect_checkpoint(str(path), pattern="nothing*").items == []


def test_step_sources(tmp_path):
    p = tmp_path / "step_00000042"
    save(p, {"model": {"w": __import__("torch").ones(3)}})
    assert inspect_checkpoint(str(p)).step == 42  # from the directory name
    q = tmp_path / "other"
    save(q, {"model": {"w": __import__("torch").ones(3)}}, metadata={TRAINING_STATE_KEY: {"step": 7}})
    assert inspect_checkpoint(str(q)).step == 7  # CheckpointManager's record
    r = tmp_path / "plain"
    save(r, {"model": {"w": __import__("torch").ones(3)}})
    assert inspect_checkpoint(str(r)).step is None


def test_training_state_key_matches_the_manager():
    from goodput_ckpt.state.bundle import META_KEY

    assert TRAINING_STATE_KEY == META_KEY


def test_sections_by_prefix():
    assert [
        section_of(k)
        for k in (
            "model.w",
            "model_ema.w",
            "optim.state.x",
            "optimizer.param_groups",
            "rng.rank0.cpu",
            "random.x",
            "dataloader.rank3",
            "data_loader.x",
            "scheduler.x",
            "step",
        )
    ] == ["model", "model", "optimizer", "optimizer", "rng", "rng", "dataloader", "dataloader", "extra", "extra"]


def test_damaged_and_missing(ckpt, tmp_path):
    f, _, _ = item_range(ckpt, "model.embed.weight")
    truncate(ckpt, f, 10)
    r = inspect_checkpoint(str(ckpt))
    assert r.tensors > 0 and len(r.problems) == 1 and f in r.problems[0]
    (ckpt / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CorruptCheckpointError):
        inspect_checkpoint(str(ckpt))
    (ckpt / MANIFEST_NAME).unlink()
    with pytest.raises(IncompleteCheckpointError):
        inspect_checkpoint(str(ckpt))
    with pytest.raises(CheckpointNotFoundError):
        inspect_checkpoint(str(tmp_path / "none"))


def test_invalid_manifest_is_corrupt_on_disk_and_incomplete_on_a_volume(ckpt):
    good = (ckpt / MANIFEST_NAME).read_bytes()
    for data in damaged_manifests(good).values():
        (ckpt / MANIFEST_NAME).write_bytes(data)
        with pytest.raises(CorruptCheckpointError):
            inspect_checkpoint(str(ckpt))
        with pytest.raises(IncompleteCheckpointError, match="mounted volume"):
            inspect_checkpoint(str(ckpt), volume=True)
