"""A trainer's checkpoint dict through our format (integrations/_tree.py): exact round trips of
the values trainers hold, and typed errors for hostile skeletons and unsafe values."""

from __future__ import annotations

import enum
import json
import math
from collections import OrderedDict

import pytest
import torch

from goodput_ckpt import CheckpointError, CorruptCheckpointError
from goodput_ckpt.format.manifest import MANIFEST_NAME
from goodput_ckpt.integrations._tree import MAX_DEPTH, TREE_KEY, decode_tree, encode_tree, load_tree, save_tree


class Color(enum.Enum):
    RED = 1


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b))


TREE = {
    "state_dict": OrderedDict(
        [("layer.weight", torch.randn(3, 4)), ("layer.bias", torch.zeros(3, dtype=torch.bfloat16))]
    ),
    "optimizer_states": [
        {
            "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.ones(2)}},
            "param_groups": [{"betas": (0.9, 0.999), "lr": 0.1, "foreach": None, "params": [0]}],
        }
    ],
    "numbers": [1, -0.0, math.inf, -math.inf, math.nan, 2**70, True, "text", ""],
    "odd keys": {1: "int", (1, 2): "tuple", None: "none", "T": {"d": "looks like a tag"}},
    "a/b": torch.ones(1),
    "a": {"b": torch.zeros(1)},
    "a%2Fb": torch.full((1,), 2.0),  # paths that print alike
    "size": torch.Size([2, 3]),
    "empty": {"list": [], "tuple": (), "dict": {}},
}


def test_round_trip_is_exact(tmp_path):
    save_tree(TREE, tmp_path / "c")
    back = load_tree(tmp_path / "c")
    assert _same(dict(TREE, state_dict=dict(TREE["state_dict"])), back)  # OrderedDict -> dict, order kept


def test_tensors_are_items_and_the_rest_is_json(tmp_path):
    skeleton, flat = encode_tree(TREE)
    assert "state_dict/layer.weight" in flat and "optimizer_states/0/state/0/exp_avg" in flat
    assert {"a%2Fb", "a/b", "a%2Fb~1"} <= set(flat)  # "/" in a key is escaped; a clash gets a suffix
    assert [k for k, v in flat.items() if not isinstance(v, torch.Tensor)] == ["size"]
    json.dumps(skeleton, allow_nan=False)  # strict JSON: nan and inf are tagged


def test_values_weights_only_refuses_need_trust(tmp_path):
    with pytest.warns(UserWarning, match="weights_only"):
        save_tree({"color": Color.RED}, tmp_path / "c")
    with pytest.raises(CheckpointError, match="trust_pickle"):
        load_tree(tmp_path / "c")
    assert load_tree(tmp_path / "c", trust_pickle=True) == {"color": Color.RED}


def test_cycle_is_a_typed_error():
    loop: list = []
    loop.append(loop)
    with pytest.raises(CheckpointError, match=f"deeper than {MAX_DEPTH}"):
        encode_tree(loop)


@pytest.mark.parametrize(
    "skeleton",
    [
        [1, 2],
        {"d": 1},
        {"x": 1},
        {"d": {}, "l": []},
        {"T": "missing"},
        {"m": [[1]]},
        {"m": [[{"l": []}, 1]]},
        {"f": "1e400"},
        {"T": 5},
        "deep",
    ],
)
def test_hostile_skeletons_are_corrupt(skeleton):
    if skeleton == "deep":
        skeleton = 1
        for _ in range(MAX_DEPTH + 5):
            skeleton = {"l": [skeleton]}
    with pytest.raises(CorruptCheckpointError, match="skeleton"):
        decode_tree(skeleton, {}, where="x")


def test_checkpoint_without_skeleton_is_named(tmp_path):
    import torch.distributed.checkpoint as dcp

    from goodput_ckpt import CheckpointWriter

    dcp.save({"w": torch.ones(2)}, storage_writer=CheckpointWriter(tmp_path / "plain"), no_dist=True)
    with pytest.raises(CheckpointError, match=TREE_KEY):
        load_tree(tmp_path / "plain")


def test_unknown_skeleton_version_is_refused(tmp_path):
    save_tree({"w": torch.ones(2)}, tmp_path / "c")
    doc = json.loads((tmp_path / "c" / MANIFEST_NAME).read_text())
    assert doc["metadata"][TREE_KEY]["version"] == 1
    skeleton, flat = encode_tree({"w": torch.ones(2)})
    import torch.distributed.checkpoint as dcp

    from goodput_ckpt import CheckpointWriter

    meta = {TREE_KEY: {"version": 99, "root": skeleton}}
    dcp.save(flat, storage_writer=CheckpointWriter(tmp_path / "v99", metadata=meta), no_dist=True)
    with pytest.raises(CheckpointError, match="version 99"):
        load_tree(tmp_path / "v99")


def test_core_and_integrations_package_import_no_trainer_library():
    """The core keeps no dependency on trainers: only the adapter module imports its library."""
    import subprocess
    import sys

    code = (
        "import sys, goodput_ckpt, goodput_ckpt.integrations, goodput_ckpt.integrations._tree, "
        "goodput_ckpt.integrations._locations, goodput_ckpt.integrations._processes; "
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_an_adapters_checkpoint_is_checked_for_its_kind_and_layout_version():
    """check_tree_kind: the check each trainer adapter makes; another adapter's checkpoint, a
    tree that is not a dict and a newer layout are refused by name, with quoted values cut."""
    from goodput_ckpt.integrations._tree import check_tree_kind

    tree = {"kind": "transformers.Trainer", "version": 1}
    assert check_tree_kind(tree, "/c", kind="transformers.Trainer", version=1, layout="Trainer") is tree
    with pytest.raises(CheckpointError, match=r"of 'transformers.Trainer', not of an accelerate.Accelerator"):
        check_tree_kind(tree, "/c", kind="accelerate.Accelerator", version=1, layout="Accelerate")
    with pytest.raises(CheckpointError, match=r"of 'list', not of a transformers.Trainer"):
        check_tree_kind([1], "/c", kind="transformers.Trainer", version=1, layout="Trainer")
    with pytest.raises(CheckpointError, match=r"Trainer checkpoint layout version 2 is not supported") as e:
        check_tree_kind({**tree, "version": 2}, "/c", kind="transformers.Trainer", version=1, layout="Trainer")
    assert e.value.path == "/c"
    with pytest.raises(CheckpointError) as e:
        check_tree_kind({"kind": "x" * 10_000}, "/c", kind="transformers.Trainer", version=1, layout="Trainer")
    assert len(str(e.value)) < 200
