"""Other tools' checkpoints and manager roots are named, not called interrupted saves (issue 20, item 3).

Real layouts: torch's ``FileSystemWriter``, safetensors' ``save_file`` in an HF-style
directory, and a ``CheckpointManager`` root. ``CheckpointReader`` (through ``dcp.load``),
``verify`` and ``inspect`` all say what the location is and what reads it.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from goodput_ckpt import CheckpointManager, CheckpointReader
from goodput_ckpt.cli import main
from goodput_ckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError, find_checkpoint_error
from goodput_ckpt.format.commit_record import MISSING, read_commit_record
from goodput_ckpt.storage import open_store


def _stock_dcp(path):
    dcp.save({"w": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def _hf_dir(path):
    path.mkdir()
    save_file({"w": torch.arange(6.0)}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text("{}")


def _manager_root(path):
    with CheckpointManager(str(path), async_save=False) as mgr:
        mgr.save(3, model=torch.nn.Linear(2, 2))


LAYOUTS = {
    "dcp": (_stock_dcp, "torch DCP checkpoint", "FileSystemReader"),
    "safetensors": (_hf_dir, "safetensors directory", "goodput-ckpt convert"),
    "manager root": (_manager_root, "holds checkpoints in sub-directories (step_00000003)", "goodput-ckpt ls"),
}


@pytest.fixture(params=sorted(LAYOUTS))
def foreign(request, tmp_path):
    make, what, hint = LAYOUTS[request.param]
    make(tmp_path / "x")
    return tmp_path / "x", what, hint


def test_commit_record_names_the_layout(foreign):
    path, what, hint = foreign
    record = read_commit_record(open_store(str(path)))
    assert record.status == MISSING and what in record.message and hint in record.message
    with pytest.raises(CheckpointNotFoundError, match=what.replace("(", r"\(").replace(")", r"\)")) as e:
        record.manifest_or_raise()
    assert not isinstance(e.value, IncompleteCheckpointError)


def test_checkpoint_reader_names_the_layout(foreign):
    path, what, hint = foreign
    with pytest.raises(BaseException) as e:
        dcp.load({"w": torch.empty(6)}, storage_reader=CheckpointReader(str(path)), no_dist=True)
    err = find_checkpoint_error(e.value)
    assert err is not None and what in str(err) and hint in str(err), repr(e.value)
    assert "never committed" not in str(e.value)


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_cli_names_the_layout_and_exits_2(foreign, command, capsys):
    path, what, hint = foreign
    if (path / ".metadata").exists():
        pytest.skip("verify and inspect read a stock DCP checkpoint (issue 35): tests/tools/ops/test_dcp_foreign.py")
    assert main([command, str(path), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    text = json.dumps(doc)
    assert what in text and hint in text and "never committed" not in text


def test_an_interrupted_save_is_still_called_one(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "rank0.bin").write_bytes(b"\0" * 8)
    record = read_commit_record(open_store(str(tmp_path / "x")))
    assert record.foreign is None and "never committed" in record.message
