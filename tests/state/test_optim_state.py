"""A restore into a fresh optimizer shapes its state from the checkpoint instead of running
torch's zero-gradient step, and falls back to torch's way wherever the saved state is not what
that shaping knows. Real saves and restores through the manager, one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from goodput_ckpt import CheckpointManager
from goodput_ckpt.state import optim_state


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(model, opt, steps: int = 3) -> None:
    for i in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 8, generator=torch.Generator().manual_seed(i))).square().sum().backward()
        opt.step()


def _states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        assert sa["state"][k].keys() == sb["state"][k].keys()
        for name, v in sa["state"][k].items():
            w = sb["state"][k][name]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and v.shape == w.shape and torch.equal(v, w), (k, name)
            else:
                assert v == w, (k, name)
    assert sa["param_groups"] == sb["param_groups"]


def _saved(tmp_path, make, model: nn.Module | None = None):
    """A model and optimizer trained 3 steps and saved as step 3, and a fresh pair to restore."""
    model = _model() if model is None else model
    opt = make(model.parameters())
    _train(model, opt)
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(3, model=model, optimizer=opt)
        mgr.wait()
    fresh = _model(seed=1)
    return model, opt, fresh, make(fresh.parameters())


def _count_steps(monkeypatch, cls) -> list[int]:
    calls: list[int] = []
    step = cls.step

    def counted(self, *a, **k):
        calls.append(1)
        return step(self, *a, **k)

    monkeypatch.setattr(cls, "step", counted)
    return calls


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    ],
    ids=["adamw", "adam-amsgrad", "sgd-momentum"],
)
def test_a_fresh_optimizer_is_restored_bit_exact_without_a_step(tmp_path, monkeypatch, make):
    model, opt, fresh, fresh_opt = _saved(tmp_path, make)
    calls = _count_steps(monkeypatch, type(fresh_opt))
    with CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.restore(model=fresh, optimizer=fresh_opt) == 3
    assert calls == [], "no zero-gradient step: the state was shaped from the checkpoint"
    _states_equal(opt, fresh_opt)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
    monkeypatch.undo()
    _train(model, opt, 2)
    _train(fresh, fresh_opt, 2)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q), "training goes on exactly as the saved run"


class _Factored(torch.optim.Optimizer):
    """An optimizer whose state is not shaped like its parameters (a per-row factor, as
    Adafactor keeps) and holds a plain int: torch's initialization must make it."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["rows"] = torch.zeros(p.shape[0])
                    st["count"] = 0
                st["rows"].add_(p.grad.reshape(p.shape[0], -1).square().mean(1))
                st["count"] += 1
                p.sub_(group["lr"] * p.grad / (st["rows"].reshape(-1, *[1] * (p.dim() - 1)).sqrt() + 1e-8))


def test_state_of_another_shape_keeps_torchs_initialization(tmp_path, monkeypatch):
    _, opt, fresh, fresh_opt = _saved(tmp_path, _Factored)
    calls = _count_steps(monkeypatch, _Factored)
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.restore(model=fresh, optimizer=fresh_opt)
    assert calls, "torch's zero-gradient step made the state"
    _states_equal(opt, fresh_opt)


def test_a_parameter_without_saved_state_keeps_torchs_initialization(tmp_path, monkeypatch):
    """The saved run never stepped the last layer (no state for it); a fresh optimizer that
    trains every parameter goes through torch's initialization, as before (whose strict load
    then names the missing keys)."""
    model = _model()
    for p in model[2].parameters():
        p.requires_grad_(False)
    _, _, fresh, fresh_opt = _saved(tmp_path, lambda ps: torch.optim.AdamW(ps, lr=1e-2), model)
    calls = _count_steps(monkeypatch, torch.optim.AdamW)
    with CheckpointManager(str(tmp_path)) as mgr, pytest.raises(Exception, match="2.weight|2.bias"):
        mgr.restore(model=fresh, optimizer=fresh_opt)
    assert calls, "torch's zero-gradient step ran"


def _adamw_saved(model: nn.Module) -> dict:
    """What a checkpoint of AdamW over ``model`` holds, as :func:`optim_state.saved_states` gives it."""
    from goodput_ckpt.format.schema import TensorEntry

    def entry(shape):
        return TensorEntry("k", "float32", tuple(shape), ())

    return {
        n: {"step": entry(()), "exp_avg": entry(p.shape), "exp_avg_sq": entry(p.shape)}
        for n, p in model.named_parameters()
    }


def test_an_optimizer_with_state_is_left_to_torch():
    """Valid saved state, and a fresh optimizer takes it; one that already stepped does not."""
    model = _model()
    assert optim_state.preshape(model, [torch.optim.AdamW(model.parameters(), lr=1e-2)], _adamw_saved(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1)
    opt.zero_grad(set_to_none=True)  # no gradients: only its state tells it is not fresh
    before = {p: dict(st) for p, st in opt.state.items()}
    assert optim_state.preshape(model, [opt], _adamw_saved(model)) is False
    assert all(opt.state[p][k] is v for p, st in before.items() for k, v in st.items()), "left as it was"


def test_names_torch_does_not_give_are_undone():
    """If the FQNs found here were not torch's, ``matches`` tells, and ``clear`` leaves the
    optimizer as fresh as it was (the caller then runs torch's initialization)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved = _adamw_saved(model)
    assert optim_state.preshape(model, [opt], saved)
    _, osd = get_state_dict(model, [opt], options=StateDictOptions())
    assert optim_state.matches(osd, saved)
    renamed = {f"x.{k}": v for k, v in saved.items()}
    assert not optim_state.matches(osd, renamed)
    optim_state.clear([opt])
    assert not opt.state


def test_a_failed_restore_leaves_a_fresh_optimizer_fresh(tmp_path):
    """A data file damaged after the save: the restore fails by name, and the state shaped for
    the load (uninitialized where the load did not reach) is removed again."""
    from goodput_ckpt import CorruptCheckpointError

    _, _, fresh, fresh_opt = _saved(tmp_path, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    data = [
        f
        for f in (tmp_path / "step_00000003").rglob("*")
        if f.is_file() and f.name.startswith("rank") and f.suffix == ".bin"
    ]
    assert data, "a data file to damage"
    for f in data:
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
    with CheckpointManager(str(tmp_path)) as mgr, pytest.raises(CorruptCheckpointError):
        mgr.restore(3, model=fresh, optimizer=fresh_opt)
    assert not fresh_opt.state, "no state left that no step made"


def _fsdp_worker(rank: int, world_size: int, root: str) -> None:
    """FSDP2 on gloo: AdamW's state is DTensors; a fresh optimizer gets DTensor state of the
    parameters' placement, loaded bit for bit, with no zero-gradient step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,))

    def make(seed):
        model = _model(seed)
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = make(0)
    _train(model, opt)
    with CheckpointManager(root) as mgr:
        mgr.save(3, model=model, optimizer=opt)
        mgr.wait()
    fresh, fresh_opt = make(1)
    calls: list[int] = []
    step = torch.optim.AdamW.step
    torch.optim.AdamW.step = lambda self, *a, **k: (calls.append(1), step(self, *a, **k))[1]
    try:
        with CheckpointManager(root) as mgr:
            assert mgr.restore(model=fresh, optimizer=fresh_opt) == 3
    finally:
        torch.optim.AdamW.step = step
    assert calls == [], f"rank {rank}: no zero-gradient step"
    for p, q in zip(opt.param_groups[0]["params"], fresh_opt.param_groups[0]["params"]):
        for name, v in opt.state[p].items():
            w = fresh_opt.state[q][name]
            assert type(v) is type(w), (name, type(v), type(w))
            if isinstance(v, DTensor):
                assert v.placements == w.placements and torch.equal(v.to_local(), w.to_local()), name
            else:
                assert torch.equal(v, w), name
    _train(model, opt, 2)
    _train(fresh, fresh_opt, 2)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), "training goes on exactly as the saved run"


@pytest.mark.multiproc
def test_fsdp2_optimizer_state_is_shaped_as_dtensors_and_restored_bit_exact(tmp_path):
    from helpers.dist import run_ranks

    run_ranks(_fsdp_worker, 2, str(tmp_path / "ckpt"), report_dir=tmp_path / "reports", timeout=240)


class _Scaled(nn.Module):
    """A model with a 0-dim parameter (as CLIP's ``logit_scale``): its AdamW ``step`` and its
    moments are all 0-dim, and ``step`` must still be the CPU tensor torch makes."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.body(x) * self.scale


def test_a_scalar_parameters_step_is_a_plain_cpu_tensor(tmp_path, monkeypatch):
    model = _Scaled()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(3, model=model, optimizer=opt)
        mgr.wait()
    fresh = _Scaled(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    calls = _count_steps(monkeypatch, torch.optim.AdamW)
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.restore(model=fresh, optimizer=fresh_opt)
    assert calls == []
    _states_equal(opt, fresh_opt)
    step = fresh_opt.state[fresh.scale]["step"]
    assert type(step) is torch.Tensor and step.device.type == "cpu" and step is not fresh.scale
    # where a copy of the parameter would differ (a DTensor, another device): meta stands in
    from goodput_ckpt.format.schema import TensorEntry

    made = optim_state._state_for(
        nn.Parameter(torch.empty((), device="meta")),
        {"step": TensorEntry("k", "float32", (), ()), "exp_avg": TensorEntry("k", "float32", (), ())},
    )
    assert made is not None and made["step"].device.type == "cpu" and made["exp_avg"].device.type == "meta"


def test_wrapped_layers_keep_the_fast_path(tmp_path, monkeypatch):
    """Activation-checkpoint wrappers rename parameters (``_checkpoint_wrapped_module``); torch's
    FQNs drop that, and so does the shaping: no step, bit-exact."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def wrapped(seed):
        m = _model(seed)
        m[0] = checkpoint_wrapper(m[0])
        return m

    model = wrapped(0)
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(3, model=model, optimizer=opt)
        mgr.wait()
    fresh = wrapped(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    calls = _count_steps(monkeypatch, torch.optim.AdamW)
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.restore(model=fresh, optimizer=fresh_opt)
    assert calls == [], "the wrapper's parameters were found under torch's names"
    _states_equal(opt, fresh_opt)


def test_a_layer_frozen_since_the_save_goes_through_torchs_way(tmp_path, monkeypatch):
    """The checkpoint holds state for a layer the fresh job froze: the names ``get_state_dict``
    gives differ from the saved ones, the shaped state is removed, and torch's step makes it;
    the trainable parameters get the saved state."""
    model, opt, fresh, _ = _saved(tmp_path, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    for p in fresh[2].parameters():
        p.requires_grad_(False)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    calls = _count_steps(monkeypatch, torch.optim.AdamW)
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.restore(model=fresh, optimizer=fresh_opt)
    assert calls, "torch's zero-gradient step ran after the names did not match"
    for p, q in zip(list(model.parameters())[:2], list(fresh.parameters())[:2]):
        for name, v in opt.state[p].items():
            assert torch.equal(v, fresh_opt.state[q][name]), name


def test_state_made_before_get_state_dict_fails_is_removed(tmp_path, monkeypatch):
    from goodput_ckpt.state import modules

    _, _, fresh, fresh_opt = _saved(tmp_path, lambda ps: torch.optim.AdamW(ps, lr=1e-2))

    def broken(*a, **k):
        assert fresh_opt.state, "called after the state was shaped"
        raise RuntimeError("injected")

    monkeypatch.setattr(modules, "model_and_optim_state", broken)
    with CheckpointManager(str(tmp_path)) as mgr, pytest.raises(Exception, match="injected"):
        mgr.restore(model=fresh, optimizer=fresh_opt)
    assert not fresh_opt.state


def test_a_failure_after_the_optimizer_was_loaded_keeps_its_state(tmp_path):
    """A stateful object that fails to load after ``set_state_dict`` ran: the optimizer keeps
    the checkpoint's state (it is loaded, not shaped memory)."""

    class Fails:
        def state_dict(self):
            return {"x": torch.tensor(1)}

        def load_state_dict(self, state):
            raise RuntimeError("stateful refuses")

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(3, model=model, optimizer=opt, thing=Fails())
        mgr.wait()
    fresh = _model(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with CheckpointManager(str(tmp_path)) as mgr, pytest.raises(Exception, match="stateful refuses"):
        mgr.restore(model=fresh, optimizer=fresh_opt, thing=Fails())
    _states_equal(opt, fresh_opt)
