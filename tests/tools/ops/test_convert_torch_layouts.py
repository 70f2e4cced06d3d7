"""torch's other checkpoint layouts in convert (issue 20, item 4), written by torch itself.

- DCP with ``serialization_format=SAFETENSORS``: refused by name (it used to fail inside
  ``torch.load`` with an unpickling error asking to file an issue);
- ``HuggingFaceStorageWriter(save_distributed=True)``: each rank's partial shard is merged,
  as torch's own reader merges them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.dist import run_ranks

from goodput_ckpt.errors import CheckpointError, CorruptCheckpointError
from goodput_ckpt.tools.ops.convert import convert_checkpoint

FULL = {"a": torch.arange(15.0).reshape(5, 3), "b": torch.arange(4, dtype=torch.bfloat16)}


def test_dcp_saved_with_safetensors_serialization_is_refused_by_name(tmp_path):
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    writer = dcp.FileSystemWriter(str(tmp_path / "st"), serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save(dict(FULL), storage_writer=writer, no_dist=True)
    with pytest.raises(CheckpointError, match="serialization_format=SAFETENSORS") as e:
        convert_checkpoint(str(tmp_path / "st"), str(tmp_path / "out"), to="goodput")
    assert "Unpickling" not in str(e.value) and not (tmp_path / "out").exists()


def _hf_distributed_save(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    sd = {"a": distribute_tensor(FULL["a"], mesh, [Shard(0)]), "b": FULL["b"].clone()}
    writer = HuggingFaceStorageWriter(path, save_distributed=True, fqn_to_index_mapping={"a": 1, "b": 1})
    dcp.save(sd, storage_writer=writer)


@pytest.fixture(scope="module")
def hf_distributed(tmp_path_factory):
    path = tmp_path_factory.mktemp("hfdist") / "ckpt"
    path.mkdir()
    run_ranks(_hf_distributed_save, 2, str(path), report_dir=path.parent / "reports", timeout=240)
    return path


def test_hf_distributed_partial_shards_are_merged(hf_distributed, tmp_path):
    assert len(list(hf_distributed.glob("*.safetensors"))) == 2  # one partial file per rank
    r = convert_checkpoint(str(hf_distributed), str(tmp_path / "m.pt"), to="torch")
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert r.tensors == 2 and got.keys() == FULL.keys()
    for k, v in FULL.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_a_missing_rank_file_is_named(hf_distributed, tmp_path):
    """Rank 0's file missing: rank 1's part of 'a' starts at row 3, so rows 0-2 are absent.
    (A missing *last* part cannot be told: the format records no full shape, torch's reader
    infers it from the parts as convert does.)"""
    import shutil

    partial = tmp_path / "partial"
    partial.mkdir()
    second = sorted(hf_distributed.glob("*.safetensors"))[1]
    shutil.copy(second, partial / second.name)
    with pytest.raises(CorruptCheckpointError, match="partial shards of 'a'"):
        convert_checkpoint(str(partial), str(tmp_path / "m.pt"), to="torch")
