"""Every case of the hostile-manifest corpus (tests/format/hostile/) reaches the same verdict in
``verify``, ``inspect`` and ``dcp.load``: one validation decides for all of them (issue 22 s1,
issue 16 item 13). Before, ``verify`` said OK for manifests that ``dcp.load`` refused (a
malformed ``dcp.planner_data``, NaN in the metadata).

Verdicts: ``ok``, ``corrupt``, ``incomplete`` or ``unsupported`` (a version this library does
not read).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from goodput_ckpt import CheckpointError, CheckpointReader, CorruptCheckpointError, IncompleteCheckpointError
from goodput_ckpt.errors import find_checkpoint_error
from goodput_ckpt.format.manifest import MANIFEST_NAME
from goodput_ckpt.tools.ops.inspect import inspect_checkpoint
from goodput_ckpt.tools.ops.verify import verify_checkpoint

HOSTILE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "format", "hostile"
)
with open(os.path.join(HOSTILE, "expected.json")) as _f:
    _EXPECTED = json.load(_f)


def _location(root, name: str) -> str:
    """The corpus's data files (zeros, as every manifest there describes) plus manifest ``name``."""
    os.makedirs(root)
    for data_file, size in _EXPECTED["data_files"].items():
        with open(os.path.join(root, data_file), "wb") as f:
            f.write(bytes(size))
    with open(os.path.join(HOSTILE, name), "rb") as src, open(os.path.join(root, MANIFEST_NAME), "wb") as f:
        f.write(src.read())
    return str(root)


def _verdict_of(err: CheckpointError) -> str:
    if isinstance(err, CorruptCheckpointError):
        return "corrupt"
    if isinstance(err, IncompleteCheckpointError):
        return "incomplete"
    assert type(err) is CheckpointError and "format version" in str(err), f"unexpected {type(err).__name__}: {err}"
    return "unsupported"  # a version this library does not read (or none at all)


def _inspect_verdict(loc: str) -> str:
    try:
        report = inspect_checkpoint(loc)
    except CheckpointError as e:
        return _verdict_of(e)
    return "corrupt" if report.problems else "ok"


def _load_verdict(loc: str) -> str:
    sd = {"w": torch.ones(16, 128), "b": torch.ones(4, dtype=torch.int64)}
    try:
        dcp.load(sd, storage_reader=CheckpointReader(loc))
    except CheckpointException as exc:
        err = find_checkpoint_error(exc)
        if err is None:  # torch keeps only the message of an error in read_metadata
            with pytest.raises(CheckpointError) as info:
                CheckpointReader(loc).read_metadata()
            err = info.value
            assert str(err) in str(exc), exc
        return _verdict_of(err)
    assert not sd["w"].any() and not sd["b"].any()  # loaded: the corpus's data is zeros
    return "ok"


@pytest.mark.parametrize("name", ["valid.json", *sorted(_EXPECTED["cases"])])
def test_verify_inspect_and_load_agree(name, tmp_path):
    loc = _location(tmp_path / "ckpt", name)
    verdicts = {
        "verify": verify_checkpoint(loc).status,
        "inspect": _inspect_verdict(loc),
        "dcp.load": _load_verdict(loc),
    }
    assert len(set(verdicts.values())) == 1, verdicts
    assert (verdicts["verify"] == "ok") == (name == "valid.json"), verdicts
