"""The training-state bundle: metadata it records, and how a restore reads it back."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from goodput_ckpt.dcp.rank_rows import RankRow
from goodput_ckpt.errors import CheckpointError, CorruptCheckpointError
from goodput_ckpt.format.manifest import Manifest
from goodput_ckpt.state import META_KEY, Topology, build_save_state, normalize, training_meta
from goodput_ckpt.state.dataloader import decode_dataloader_row, encode_dataloader_state
from goodput_ckpt.state.rng import rng_layout, row_width


def _manifest(metadata):
    return Manifest(
        version=1,
        library_version="0",
        torch_version="0",
        created_at="",
        world_size=1,
        chunk_size=1 << 20,
        files={},
        items={},
        metadata=metadata,
    )


def test_save_state_sections_and_metadata():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Loader:
        num_workers, batch_size = 2, 8

        def state_dict(self):
            return {"pos": 5, "gen": torch.arange(3)}

        def load_state_dict(self, sd):
            pass

    state, meta = build_save_state(
        7,
        models=normalize(model, opt),
        dataloader=Loader(),
        stateful={},
        topology=Topology(1, 2),
        save_rng=True,
        extra={"epoch": 1},
    )
    assert set(state) == {"model", "optimizer", "rng", "dataloader"}
    (row,) = state["rng"].values()
    assert isinstance(row, RankRow) and (row.rank, row.world_size) == (1, 2), "row 1 of one tensor for all ranks"
    assert row.size() == (2, row_width(rng_layout())) and not row.widen
    (dl,) = state["dataloader"].values()
    assert isinstance(dl, RankRow) and (dl.rank, dl.world_size, dl.widen) == (1, 2, True), "widened to the longest"
    ts = meta[META_KEY]
    assert ts["step"] == 7 and ts["world_size"] == 2 and ts["sections"] == ["model", "optimizer", "rng", "dataloader"]
    assert ts["dataloader"]["num_workers"] == 2 and ts["dataloader"]["batch_size"] == 8
    assert meta["extra"] == {"epoch": 1}
    back = decode_dataloader_row(dl.padded(dl.row.shape[1] + 5), key="k")  # padding is ignored
    assert back["pos"] == 5 and torch.equal(back["gen"], torch.arange(3))


def test_training_meta_validation():
    with pytest.raises(CheckpointError, match="not written by CheckpointManager"):
        training_meta(_manifest({}), "loc")
    with pytest.raises(CorruptCheckpointError, match="schema version 99 is not supported") as info:
        training_meta(_manifest({META_KEY: {"schema": 99}}), "loc")
    assert info.value.version == 99
    for schema in (True, "2", 0, 3):
        with pytest.raises(CorruptCheckpointError, match="is not supported"):
            training_meta(_manifest({META_KEY: {"schema": schema}}), "loc")
    good = {"schema": 1, "step": 1, "world_size": 2, "sections": ["model"], "rng": None, "dataloader": None}
    assert training_meta(_manifest({META_KEY: good}), "loc")["world_size"] == 2
    assert training_meta(_manifest({META_KEY: {**good, "schema": 2}}), "loc")["schema"] == 2
    for bad in ({"world_size": 0}, {"world_size": True}, {"sections": "model"}, {"rng": [1]}, {"models": [1]}):
        with pytest.raises(CorruptCheckpointError):
            training_meta(_manifest({META_KEY: {**good, **bad}}), "loc")


def test_dataloader_blob_is_weights_only_safe():
    class Loader:
        def state_dict(self):
            return {"x": [1, 2, {"y": torch.ones(2)}]}

    blob = encode_dataloader_state(Loader(), key="k")
    assert blob.dtype == torch.uint8
    raw = blob.numpy().tobytes()
    assert torch.load(io.BytesIO(raw), weights_only=True)["x"][2]["y"].sum() == 2


def test_normalize_checks_shapes():
    m = nn.Linear(2, 2)
    o = torch.optim.SGD(m.parameters(), lr=1)
    assert normalize(m, [o, o]).pairs[""][1] == [o, o]
    assert normalize({"a": m}, {"a": o}).describe() == {"models": ["a"], "optimizers": ["a"]}
    with pytest.raises(TypeError, match="not model names"):
        normalize({"a": m}, {"b": o})
    with pytest.raises(TypeError):
        normalize({"a.b": m}, None)
    with pytest.raises(TypeError):
        normalize(m, "adam")


def test_the_metadata_step_is_bounded_before_it_seeds_generators():
    """Issue 33: the step seeds re-derived generators after a topology change (a signed 64-bit
    field); 2**70 failed in ``apply_restore`` after the model was loaded."""
    good = {"schema": 2, "step": 1, "world_size": 2, "sections": ["model"], "rng": None, "dataloader": None}
    for step in (2**70, -1, 1.5, "3", True, float("inf")):
        with pytest.raises(CorruptCheckpointError, match="step"):
            training_meta(_manifest({META_KEY: {**good, "step": step}}), "loc")
    assert training_meta(_manifest({META_KEY: {**good, "step": 2**63 - 1}}), "loc")["step"] == 2**63 - 1
