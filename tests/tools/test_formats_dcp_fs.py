"""Hostile DCP ``.metadata``: claims the stored files cannot back are refused before any
planning or allocation, and the file itself is read with a cap."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import metadata as md

from goodput_ckpt import CorruptCheckpointError
from goodput_ckpt.storage import open_store
from goodput_ckpt.tools._formats import dcp_fs
from goodput_ckpt.tools._formats.dcp_fs import DcpSource


@pytest.fixture
def dcp_dir(tmp_path):
    d = tmp_path / "dcp"
    dcp.save(
        {"w": torch.arange(12.0).reshape(3, 4), "step": 7, "blob": b"x" * 100}, storage_writer=FileSystemWriter(str(d))
    )
    return d


def _edit(d, fn) -> None:
    meta = pickle.loads((d / ".metadata").read_bytes())
    fn(meta)
    (d / ".metadata").write_bytes(pickle.dumps(meta))


def _set_tensor(meta, **changes) -> None:
    meta.state_dict_metadata["w"] = dataclasses.replace(meta.state_dict_metadata["w"], **changes)


def _huge_no_chunks(meta) -> None:
    _set_tensor(meta, size=torch.Size([1 << 59]), chunks=[])


def _chunk_outside(meta) -> None:
    (c,) = meta.state_dict_metadata["w"].chunks
    _set_tensor(meta, chunks=[md.ChunkStorageMetadata(offsets=c.offsets, sizes=torch.Size([3, 5]))])


def _bigger_than_stored(meta) -> None:
    # Shape and chunk agree, but the chunk's archive cannot hold 2^40 float32 elements.
    _set_tensor(
        meta,
        size=torch.Size([1 << 40, 4]),
        chunks=[md.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([1 << 40, 4]))],
    )


def _negative_size(meta) -> None:
    _set_tensor(meta, size=torch.Size([-3, 4]))


def _object_length(meta) -> None:
    for idx, info in meta.storage_data.items():
        if idx.fqn == "blob":
            meta.storage_data[idx] = dataclasses.replace(info, length=5 << 30)


def _object_offset(meta) -> None:
    for idx, info in meta.storage_data.items():
        if idx.fqn == "step":
            meta.storage_data[idx] = dataclasses.replace(info, offset=-8)


@pytest.mark.parametrize(
    "edit", [_huge_no_chunks, _chunk_outside, _bigger_than_stored, _negative_size, _object_length, _object_offset]
)
def test_claims_the_files_cannot_back_are_refused_on_open(dcp_dir, edit):
    _edit(dcp_dir, edit)
    with pytest.raises(CorruptCheckpointError) as info:
        DcpSource(open_store(str(dcp_dir)))
    assert info.value.key in ("w", "blob", "step")


def test_untouched_metadata_still_opens(dcp_dir):
    _edit(dcp_dir, lambda meta: None)
    with DcpSource(open_store(str(dcp_dir))) as s:
        assert set(s.items) == {"w", "step", "blob"}


def test_metadata_over_the_cap_is_refused_before_it_is_read(dcp_dir, monkeypatch):
    size = (dcp_dir / ".metadata").stat().st_size
    monkeypatch.setattr(dcp_fs, "MAX_METADATA_BYTES", size - 1)
    with pytest.raises(CorruptCheckpointError, match="limit"):
        DcpSource(open_store(str(dcp_dir)))


def test_dcp_output_never_carries_a_pickle_our_reader_refuses(tmp_path):
    from helpers.samples import Evil

    from goodput_ckpt import CheckpointError, CheckpointWriter
    from goodput_ckpt.tools.ops.convert import convert_checkpoint

    marker = tmp_path / "pwned"
    src = tmp_path / "ours"
    with pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(2), "evil": Evil(str(marker))}, storage_writer=CheckpointWriter(str(src)))
    out = tmp_path / "dcp-out"
    with pytest.raises(CheckpointError, match="trust-pickle"):
        convert_checkpoint(str(src), str(out), to="dcp")
    assert not (out / ".metadata").exists() and not marker.exists()
    # Plain values are re-encoded and load with torch's own reader.
    src2 = tmp_path / "plain"
    dcp.save({"w": torch.ones(2), "lr": 0.5, "names": ["a", ("b", 1)]}, storage_writer=CheckpointWriter(str(src2)))
    convert_checkpoint(str(src2), str(tmp_path / "dcp2"), to="dcp")
    got = {"w": torch.zeros(2), "lr": None, "names": None}
    dcp.load(got, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp2")))
    assert got["lr"] == 0.5 and got["names"] == ["a", ("b", 1)] and torch.equal(got["w"], torch.ones(2))


def test_planner_data_with_a_huge_list_index_is_refused_before_writing(dcp_dir, tmp_path):
    from goodput_ckpt.tools.ops.convert import convert_checkpoint

    def huge_index(meta):
        # 2^20 fails fast without the check (a list of 2^20 slots); 2^40 would exhaust memory.
        meta.planner_data = {"w": ("layers", 1 << 20, "w"), "step": ("step",), "blob": ("blob",)}

    _edit(dcp_dir, huge_index)
    out = tmp_path / "out.pt"
    with pytest.raises(CorruptCheckpointError, match="planner_data") as info:
        convert_checkpoint(str(dcp_dir), str(out), to="torch")
    assert info.value.key == "w" and not out.exists()
