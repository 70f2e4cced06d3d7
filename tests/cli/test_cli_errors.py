"""Every error reaches the user as a message and exit 1 (never a traceback), and exit 2 is kept
for usage errors: a ValueError raised while parsing data is a failure, not a usage error."""

from __future__ import annotations

import base64
import io
import json
import struct

import pytest

import goodput_ckpt.tools.ops.convert as convert_tool
from goodput_ckpt.cli import EXIT_FAILED, EXIT_USAGE, main


def run(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def _deep(n: int):
    v: list = []
    for _ in range(n):
        v = [v]
    return v


def _recursion():
    json.dumps(_deep(100_000))


def _data_value_error():
    json.loads("{not json")  # a ValueError raised by a parser, not by an argument check


FAULTS = {
    "MemoryError": lambda: (_ for _ in ()).throw(MemoryError()),
    "RecursionError": _recursion,
    "OverflowError": lambda: int(float("1e400")),
    "IndexError": lambda: [][3],
    "RuntimeError": lambda: __import__("torch").empty(4).reshape(-2, -2),
    "JSONDecodeError": _data_value_error,
}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_errors_from_the_work_are_exit_1_with_a_message(name, tmp_path, monkeypatch):
    def fail(*a, **k):
        FAULTS[name]()

    monkeypatch.setattr(convert_tool, "convert_checkpoint", fail)
    code, out, err = run("convert", tmp_path / "a", tmp_path / "b", "--to", "goodput")
    assert code == EXIT_FAILED
    assert "Traceback" not in err and "Traceback" not in out
    assert name in err and "error:" in err and "--debug" in err
    code, out, err = run("convert", tmp_path / "a", tmp_path / "b", "--to", "goodput", "--json")
    doc = json.loads(out)
    assert code == EXIT_FAILED and doc["ok"] is False and doc["error"]["type"] == name


def test_argument_errors_stay_usage_errors(sample_ckpt):
    code, _, err = run("convert", sample_ckpt[0], sample_ckpt[0], "--to", "goodput")
    assert code == EXIT_USAGE and "differ" in err and "Traceback" not in err


def test_hostile_foreign_inputs_are_exit_1(tmp_path):
    # A safetensors shape of 1e400 (an OverflowError in int()) and a sidecar tensor of negative
    # shape (a RuntimeError in reshape) are refused as corrupt inputs.
    raw = b'{"a": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}}'
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4))
    code, _, err = run("convert", tmp_path / "x.safetensors", tmp_path / "o1", "--to", "goodput")
    assert code == EXIT_FAILED and "Traceback" not in err
    d = tmp_path / "st"
    d.mkdir()
    raw = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4))
    side = {
        "format": "goodput-ckpt.objects",
        "version": 1,
        "planner_data": None,
        "metadata": {},
        "objects": {
            "t": {"$tensor": {"dtype": "float32", "shape": [-2, -2], "data": base64.b64encode(bytes(16)).decode()}}
        },
    }
    (d / "model.objects.json").write_text(json.dumps(side))
    code, _, err = run("convert", d, tmp_path / "o2", "--to", "goodput")
    assert code == EXIT_FAILED and "Traceback" not in err and "shape" in err


def test_a_ctrl_c_that_dcp_wrapped_exits_130(tmp_path, monkeypatch):
    """torch's DCP wraps a KeyboardInterrupt that hits a save or a load into its
    CheckpointException (a BaseException); the CLI still exits 130, as for a bare Ctrl-C."""
    from torch.distributed.checkpoint.api import CheckpointException

    def interrupted(*a, **k):
        raise CheckpointException("save", {0: KeyboardInterrupt()})

    monkeypatch.setattr(convert_tool, "convert_checkpoint", interrupted)
    code, _, err = run("convert", tmp_path / "a", tmp_path / "b", "--to", "goodput")
    assert code == 130 and "interrupted" in err and "Traceback" not in err


def test_a_dcp_failure_is_one_line_and_its_chain_only_with_debug(tmp_path, monkeypatch):
    """Issue 35, item 3: the cause on the first (only) line; DCP's per-rank tracebacks with
    --debug. The error is a real one (torch's planner refusing a shape inside dcp.load), raised
    where ``verify`` would raise."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import goodput_ckpt.tools.ops.verify as verify_tool
    from goodput_ckpt import CheckpointReader, CheckpointWriter
    from goodput_ckpt.errors import as_checkpoint_error

    path = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(4, 2)}, storage_writer=CheckpointWriter(path), no_dist=True)
    try:
        dcp.load({"w": torch.zeros(3, 3)}, storage_reader=CheckpointReader(path), no_dist=True)
    except CheckpointException as e:
        err = as_checkpoint_error(e, "loading step 1")

    def fail(*_a, **_k):
        raise err

    monkeypatch.setattr(verify_tool, "verify_checkpoint", fail)
    code, _, text = run("verify", path)
    assert code == EXIT_FAILED and len(text.splitlines()) == 1, text
    assert text.startswith("goodput-ckpt verify: error: loading step 1 failed on rank 0: ValueError: Size mismatch")
    code, _, text = run("verify", path, "--debug")
    assert code == EXIT_FAILED and "Traceback" in text and "CheckpointException" in text
    assert text.rstrip().splitlines()[-1].startswith("goodput-ckpt verify: error: loading step 1 failed on rank 0")
