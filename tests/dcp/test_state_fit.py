"""Errors that name the cause in one line (issue 35, item 3).

Restoring into a model of another shape, or with SGD where AdamW was saved, used to raise a
CheckpointError whose text began "CheckpointException ranks:dict_keys([0])" and held a DCP
traceback, the cause on its last line. Now its message is one line that starts with the cause;
the traceback stays on ``__cause__``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from goodput_ckpt import CheckpointError, CheckpointManager, CheckpointReader, CheckpointWriter
from goodput_ckpt.dcp.load_planner import GridLoadPlanner
from goodput_ckpt.dcp.state_fit import check_fit


def _model(out: int = 2, hidden: int = 8) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, out))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A manager checkpoint of a model trained one AdamW step."""
    root = tmp_path_factory.mktemp("fit") / "root"
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with CheckpointManager(str(root), async_save=False) as cm:
        cm.save(1, model=model, optimizer=opt)
    return root


def _restore_error(root, model, optimizer=None) -> CheckpointError:
    with CheckpointManager(str(root), async_save=False) as cm:
        with pytest.raises(CheckpointError) as info:
            cm.restore(model=model, optimizer=optimizer)
    return info.value


def _one_line_with_cause(err: CheckpointError) -> str:
    text = str(err)
    assert "\n" not in text and "CheckpointException" not in text and "Traceback" not in text, text
    assert isinstance(err.__cause__, CheckpointException)  # the full chain, for whoever wants it
    return text


def test_a_model_of_another_shape_names_key_and_both_shapes(saved):
    text = _one_line_with_cause(_restore_error(saved, _model(out=3)))
    assert text.startswith(
        "the state dict does not fit the checkpoint: model.2.weight: saved float32 (2, 8), this state dict's float32 (3, 8)"
    )
    assert "model.2.bias: saved float32 (2,), this state dict's float32 (3,)" in text


def test_sgd_where_adamw_was_saved_names_the_differing_options(saved):
    model = _model()
    err = _restore_error(saved, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    text = _one_line_with_cause(err)
    assert text.startswith(
        "the state dict does not fit the checkpoint: the optimizer at optimizer.* is not the kind that was saved"
    )
    assert "its param_groups have dampening, momentum, nesterov, which the saved ones lack" in text
    assert "the saved ones have amsgrad, betas" in text
    assert "optimizer.param_groups.0.momentum" in err.key


def test_an_optimizer_whose_state_names_differ(tmp_path):
    """Unit level, on the metadata of a real save: a live optimizer with other state names."""
    model = _model()
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    adam.step()
    dcp.save(
        {"optim": adam.state_dict()["state"][0] | {}, "pg": {"param_groups": [{"lr": 1.0}]}},
        storage_writer=CheckpointWriter(str(tmp_path / "ck")),
        no_dist=True,
    )
    md = CheckpointReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata
    saved = {f"o.state.w.{k.split('.', 1)[1]}": v for k, v in md.items() if k.startswith("optim.")}
    saved["o.param_groups.0.lr"] = md["pg.param_groups.0.lr"]
    local = {
        "o.state.w.momentum_buffer": torch.zeros(8, 4),
        "o.param_groups.0.lr": 0.1,
        "o.param_groups.0.momentum": 0.9,
    }
    with pytest.raises(CheckpointError) as info:
        check_fit(local, saved)
    assert "its state holds momentum_buffer, the saved state exp_avg, exp_avg_sq, step" in str(info.value)


def test_missing_keys_are_named_and_counted(saved):
    model = torch.nn.Sequential(_model(), torch.nn.Linear(2, 2))  # other names: model.0.0.weight ...
    text = _one_line_with_cause(_restore_error(saved, model))
    assert (
        "the checkpoint has no model.0.0.weight, model.0.0.bias, model.0.2.weight and 3 more (6 key(s) this state dict expects)"
        in text
    )


def test_a_dtype_change_alone_is_not_an_error_and_a_partial_load_is_allowed(saved):
    model = _model().double()  # DCP casts while copying, as torch does
    with CheckpointManager(str(saved), async_save=False) as cm:
        assert cm.restore(model=model) == 1
    assert model[0].weight.dtype == torch.float64
    step = saved / "step_00000001"
    dest = {"model.0.weight": torch.zeros(8, 4)}
    dcp.load(
        dest, storage_reader=CheckpointReader(str(step)), planner=GridLoadPlanner(allow_partial_load=True), no_dist=True
    )
    assert dest["model.0.weight"].abs().sum() > 0


def test_plain_dcp_load_with_the_planner_reports_the_same_cause(saved):
    step = saved / "step_00000001"
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            {"model.0.weight": torch.zeros(3, 3)},
            storage_reader=CheckpointReader(str(step)),
            planner=GridLoadPlanner(),
            no_dist=True,
        )
    from goodput_ckpt.errors import find_checkpoint_error

    assert str(find_checkpoint_error(info.value)) == (
        "the state dict does not fit the checkpoint: model.0.weight: saved float32 (8, 4), this state dict's float32 (3, 3)"
    )
