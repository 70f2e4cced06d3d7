"""Deflate bombs in non-tensor values are refused before they inflate, on every decode path,
and a ``weights_only`` refusal names the refused global without terminal codes."""

from __future__ import annotations

import io
import os
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from goodput_ckpt import CheckpointError, CheckpointReader, CheckpointWriter, CorruptCheckpointError
from goodput_ckpt.engine.untrusted_load import MAX_INFLATION, check_inflation, weights_only_refusal
from goodput_ckpt.errors import find_checkpoint_error
from goodput_ckpt.storage import open_store
from goodput_ckpt.tools._formats.dcp_fs import DcpSource
from goodput_ckpt.tools.ops.convert import convert_checkpoint

BOMB_BYTES = 4 * MAX_INFLATION


def _deflated(value) -> bytes:
    """``torch.save(value)`` with every entry re-compressed: torch.load still reads it."""
    buf = io.BytesIO()
    torch.save(value, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info.filename))
    return out.getvalue()


BOMB = _deflated(b"\0" * BOMB_BYTES)


class _BombPlanner(DefaultSavePlanner):
    """Writes the value of key ``blob`` as the deflated archive (a hostile writer)."""

    def transform_object(self, write_item, object):
        if write_item.index.fqn == "blob":
            return io.BytesIO(BOMB)
        return super().transform_object(write_item, object)


def test_the_bomb_is_small_and_torch_would_inflate_it():
    assert len(BOMB) < BOMB_BYTES // 100
    assert len(torch.load(io.BytesIO(BOMB), weights_only=True)) == BOMB_BYTES


def test_check_inflation_refuses_the_bomb_and_passes_torch_save_output(tmp_path):
    with pytest.raises(CorruptCheckpointError, match=f"'blob'.*{MAX_INFLATION}") as info:
        check_inflation(BOMB, "value 'blob'", key="blob")
    assert info.value.key == "blob"
    buf = io.BytesIO()
    torch.save({"a": b"\0" * BOMB_BYTES}, buf)
    check_inflation(buf.getvalue(), "plain")
    path = tmp_path / "bomb.pt"
    path.write_bytes(BOMB)
    with pytest.raises(CorruptCheckpointError):
        check_inflation(str(path), str(path))


def test_goodput_reader_refuses_a_bomb_value_by_key(tmp_path):
    d = tmp_path / "ours"
    dcp.save({"w": torch.ones(2), "blob": b"x"}, storage_writer=CheckpointWriter(str(d)), planner=_BombPlanner())
    got = {"w": torch.zeros(2), "blob": None}
    with pytest.raises(BaseException) as info:  # dcp.load wraps it in its CheckpointException
        dcp.load(got, storage_reader=CheckpointReader(str(d)))
    inner = find_checkpoint_error(info.value)
    assert isinstance(inner, CorruptCheckpointError) and inner.key == "blob"
    with pytest.raises(CorruptCheckpointError, match="blob"):
        convert_checkpoint(str(d), str(tmp_path / "out.pt"), to="torch")


def test_dcp_input_refuses_a_bomb_value_by_key(tmp_path):
    d = tmp_path / "dcp"
    dcp.save({"w": torch.ones(2), "blob": b"x"}, storage_writer=FileSystemWriter(str(d)), planner=_BombPlanner())
    with DcpSource(open_store(str(d))) as s, pytest.raises(CorruptCheckpointError, match="blob"):
        s.object_value("blob")


def test_torch_file_input_refuses_a_bomb(tmp_path):
    path = tmp_path / "bomb.pt"
    path.write_bytes(_deflated({"w": torch.ones(2), "blob": b"\0" * BOMB_BYTES}))
    with pytest.raises(CorruptCheckpointError, match="decode to"):
        convert_checkpoint(str(path), str(tmp_path / "o"), to="goodput")


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def test_refusal_names_the_global_and_has_no_escape_codes(tmp_path):
    buf = io.BytesIO()
    torch.save({"x": _Evil()}, buf)
    with pytest.raises(Exception) as info:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    text = weights_only_refusal(info.value)
    assert "posix.system" in text and "\x1b" not in text
    # torch's other wording, with its bold/reset codes.
    msg = (
        "Weights only load failed. This file can still be loaded, \033[1mdo those steps only if you trust the source\033[0m. "
        "\n\t(1) Re-running ... "
        + "x"
        * 400
        + "\n\tWeightsUnpickler error: Unsupported global: GLOBAL mymod.Thing was not an "
        "allowed global by default."
    )
    text = weights_only_refusal(RuntimeError(msg))
    assert "mymod.Thing" in text and "\x1b" not in text
    # Through the converter: the message a user sees names the global.
    pt = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(1), "x": _Evil()}, pt)
    with pytest.raises(CheckpointError, match="posix.system") as info:
        convert_checkpoint(str(pt), str(tmp_path / "o"), to="goodput")
    assert "\x1b" not in str(info.value)
