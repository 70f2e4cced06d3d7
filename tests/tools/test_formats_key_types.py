"""Integer mapping keys survive conversion (issue 35, item 1).

An optimizer's ``state`` is keyed by parameter index; DCP's flattening writes those keys as
strings. A ``torch.save`` file converted to goodput (or safetensors) and back must give the
integer keys back, or ``optimizer.load_state_dict`` accepts string keys silently and the next
step starts from fresh moments. End to end through the real CLI, with real optimizers: the
resumed run's next step equals the uninterrupted one.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from helpers.trees import assert_tree_equal

from goodput_ckpt.cli import EXIT_OK, main
from goodput_ckpt.errors import CheckpointError, CorruptCheckpointError
from goodput_ckpt.tools._formats.key_types import find_int_keys, nest
from goodput_ckpt.tools.ops.convert import convert_checkpoint


def _cli(*argv) -> str:
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in argv], stdout=out, stderr=err)
    assert code == EXIT_OK, err.getvalue()
    return out.getvalue()


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


def _decay(step: int) -> float:
    return 0.5**step


def _train_state(name: str, with_scheduler: bool):
    torch.manual_seed(0)
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _decay) if with_scheduler else None
    return model, opt, sched


def _step(model, opt, sched, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if sched is not None:
        sched.step()


@pytest.mark.parametrize("via", ["goodput", "safetensors"])
@pytest.mark.parametrize("name,with_scheduler", [("adamw", True), ("sgd_momentum", False), ("sgd_momentum", True)])
def test_resumed_optimizer_steps_like_the_uninterrupted_one(tmp_path, name, with_scheduler, via):
    model, opt, sched = _train_state(name, with_scheduler)
    for s in range(3):
        _step(model, opt, sched, s)
    saved = {"model": model.state_dict(), "optim": opt.state_dict()}
    if sched is not None:
        saved["sched"] = sched.state_dict()
    torch.save(saved, tmp_path / "a.pt")
    assert sorted(saved["optim"]["state"]) == [0, 1, 2, 3]

    _cli("convert", tmp_path / "a.pt", tmp_path / "mid", "--to", via, *(["--all"] if via == "safetensors" else []))
    _cli("convert", tmp_path / "mid", tmp_path / "b.pt", "--to", "torch")
    back = torch.load(tmp_path / "b.pt", weights_only=True)
    assert_tree_equal(torch.load(tmp_path / "a.pt", weights_only=True), back, strict=True)

    # A fresh job (other initial weights) resumes from the round-tripped file.
    torch.manual_seed(1)
    model2 = _model()
    opt2 = OPTIMIZERS[name](model2.parameters())
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, _decay) if with_scheduler else None
    model2.load_state_dict(back["model"])
    opt2.load_state_dict(back["optim"])
    if sched2 is not None:
        sched2.load_state_dict(back["sched"])

    _step(model, opt, sched, 3)
    _step(model2, opt2, sched2, 3)
    assert_tree_equal(model.state_dict(), model2.state_dict(), strict=True)
    assert_tree_equal(opt.state_dict(), opt2.state_dict(), strict=True)


def test_the_manifest_records_which_keys_were_integers(tmp_path):
    torch.save({"state": {0: {"m": torch.ones(2)}, "1": {"m": torch.zeros(2)}}, "n": {-3: 1.5}}, tmp_path / "a.pt")
    convert_checkpoint(str(tmp_path / "a.pt"), str(tmp_path / "g"), to="goodput")
    doc = json.loads((tmp_path / "g" / "manifest.json").read_text())
    assert doc["dcp"]["int_keys"] == {"state.0.m": [1], "n.-3": [1]}  # "1" was a string: not listed
    convert_checkpoint(str(tmp_path / "g"), str(tmp_path / "b.pt"), to="torch")
    back = torch.load(tmp_path / "b.pt", weights_only=True)
    assert list(back["state"]) == [0, "1"] and list(back["n"]) == [-3]


def test_reshard_and_selection_keep_the_record(tmp_path):
    from goodput_ckpt.tools.ops.reshard import reshard_checkpoint

    torch.save(
        {"optim": {"state": {0: {"m": torch.arange(8.0)}}, "param_groups": [{"params": [0]}]}}, tmp_path / "a.pt"
    )
    convert_checkpoint(str(tmp_path / "a.pt"), str(tmp_path / "g"), to="goodput")
    reshard_checkpoint(str(tmp_path / "g"), str(tmp_path / "r"), world_size=2)
    convert_checkpoint(
        str(tmp_path / "r"), str(tmp_path / "sel"), to="goodput", keys=["optim.*"], strip_prefix="optim."
    )
    convert_checkpoint(str(tmp_path / "sel"), str(tmp_path / "b.pt"), to="torch")
    back = torch.load(tmp_path / "b.pt", weights_only=True)
    assert list(back["state"]) == [0] and back["param_groups"] == [{"params": [0]}]


def test_keys_of_other_types_are_refused_by_name(tmp_path):
    torch.save({"state": {(1, 2): torch.ones(1)}}, tmp_path / "a.pt")
    with pytest.raises(CheckpointError, match=r"state has the key \(1, 2\) of type tuple"):
        convert_checkpoint(str(tmp_path / "a.pt"), str(tmp_path / "g"), to="goodput")


def test_nest_and_find_agree_with_dcp_flattening():
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    nested = {"a": {0: {"x": torch.ones(1), 7: [torch.zeros(1), {"y": 2}]}, "b": [1, 2]}, "c": {"5": torch.ones(2)}}
    flat, mapping = flatten_state_dict(nested)
    ints = find_int_keys(nested, mapping)
    assert ints == {"a.0.x": [1], "a.0.7.0": [1, 2], "a.0.7.1.y": [1, 2]}
    assert_tree_equal(nested, nest(flat, {k: list(v) for k, v in mapping.items()}, ints), strict=True)


@pytest.mark.parametrize(
    "int_keys, why",
    [
        ({"state.0.m": [0]}, "does not spell an integer"),
        ({"state.0.m": [1, 1]}, "positions must increase"),
        ({"state.0.m": [9]}, "positions must increase and lie below 3"),
        ({"nope": [1]}, "has no planner_data path"),
        ({"state.0.m": []}, "list of 1 to 3"),
        ([1], "must be an object"),
    ],
)
def test_a_hostile_record_is_refused_when_read(tmp_path, int_keys, why):
    """The record in a manifest is checked by the parser (and never unpickled)."""
    from helpers.samples import manifest, rewrite_manifest  # seals the edited manifest again

    torch.save({"state": {0: {"m": torch.ones(2)}}}, tmp_path / "a.pt")
    convert_checkpoint(str(tmp_path / "a.pt"), str(tmp_path / "g"), to="goodput")

    doc = manifest(tmp_path / "g")
    doc["dcp"]["int_keys"] = int_keys
    rewrite_manifest(tmp_path / "g", doc)
    with pytest.raises(CorruptCheckpointError, match=why):
        convert_checkpoint(str(tmp_path / "g"), str(tmp_path / "b.pt"), to="torch")


def test_a_hostile_sidecar_record_is_refused(tmp_path):
    torch.save({"state": {0: {"m": torch.ones(2)}}, "n": 3}, tmp_path / "a.pt")
    convert_checkpoint(str(tmp_path / "a.pt"), str(tmp_path / "st"), to="safetensors")
    (sidecar,) = list((tmp_path / "st").glob("*.objects.json"))
    doc = json.loads(sidecar.read_text())
    assert doc["int_keys"] == {"state.0.m": [1]}
    doc["int_keys"] = {"state.0.m": [1], "n": [0]}
    sidecar.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="'int_keys' for 'n' marks path element 'n'"):
        convert_checkpoint(str(tmp_path / "st"), str(tmp_path / "b.pt"), to="torch")
