"""state/plain_state.py: the fast path gives torch's ``get_state_dict`` result, key by key and
value by value, for plain modules, and falls back to torch for wrapped or distributed ones."""

from __future__ import annotations

import pytest
import torch
from helpers.dist import run_ranks
from helpers.lora import adapter_optimizer, lora_model, train_step
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from goodput_ckpt.state import plain_state
from goodput_ckpt.state.plain_state import model_and_optim_state


class Counting:
    """Counts the calls of :mod:`plain_state` that went to torch's ``get_state_dict`` (the real
    one runs; the tests' own reference calls are not counted)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = plain_state.get_state_dict

        def spy(*a, **k):
            self.calls += 1
            return real(*a, **k)

        monkeypatch.setattr(plain_state, "get_state_dict", spy)


def assert_same_as_torch(model: nn.Module, opts: list[torch.optim.Optimizer]) -> None:
    """Key by key and value by value against torch's result, computed right after."""
    ours_m, ours_o = model_and_optim_state(model, opts)
    if opts:
        theirs_m, theirs_o = get_state_dict(model, opts)
    else:
        theirs_m, theirs_o = get_model_state_dict(model), None
    assert list(ours_m) == list(theirs_m)
    for k, v in theirs_m.items():
        o = ours_m[k]
        assert type(o) is type(v), k
        assert torch.equal(o, v), k
        assert o.data_ptr() == v.data_ptr() and o.stride() == v.stride() and o.dtype == v.dtype, k
        assert o.requires_grad == v.requires_grad, k
    if not opts:
        assert ours_o is None
        return
    assert list(ours_o) == list(theirs_o) == ["state", "param_groups"]
    assert list(ours_o["state"]) == list(theirs_o["state"])
    for fqn, per in theirs_o["state"].items():
        assert list(ours_o["state"][fqn]) == list(per), fqn
        for name, v in per.items():
            o = ours_o["state"][fqn][name]
            assert torch.equal(o, v) if isinstance(v, torch.Tensor) else o == v, (fqn, name)
    assert ours_o["param_groups"] == theirs_o["param_groups"]


class Net(nn.Module):
    """Tied weights, frozen parameters, persistent and non-persistent buffers, a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.ones(16))
        self.register_buffer("cache", torch.zeros(4), persistent=False)
        self.body[0].requires_grad_(False)  # frozen

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids) * self.scale))


def net_step(model: Net, opts: list[torch.optim.Optimizer]) -> None:
    model(torch.arange(8) % 50).pow(2).mean().backward()
    for o in opts:
        o.step()
        o.zero_grad(set_to_none=True)


def net_and_optimizers() -> tuple[Net, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    model = Net()
    groups = [
        {"params": [model.emb.weight], "lr": 1e-2},
        {"params": list(model.body[3].parameters()), "lr": 1e-3, "weight_decay": 0.0},
    ]
    opts = [torch.optim.AdamW(groups), torch.optim.SGD(model.body[1].parameters(), lr=0.1, momentum=0.9)]
    net_step(model, opts)
    return model, opts


def test_plain_module_matches_torch_and_uses_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opts = net_and_optimizers()
    assert_same_as_torch(model, opts)  # first call: torch's path, and the check of ours against it
    count = Counting(monkeypatch)
    for _ in range(3):
        net_step(model, opts)
        assert_same_as_torch(model, opts)
    assert count.calls == 0  # ours never went to torch
    assert plain_state._shapes[model].checked
    # Tied: one parameter, two state-dict keys; the optimizer names it by its first name.
    assert "head.weight" in model.state_dict() and "emb.weight" in model_and_optim_state(model, opts)[1]["state"]
    assert "cache" not in model_and_optim_state(model, opts)[0]  # non-persistent


def test_model_without_optimizer_matches_torch() -> None:
    model, _ = net_and_optimizers()
    assert_same_as_torch(model, [])
    assert_same_as_torch(model, [])
    assert plain_state._shapes[model].checked


def test_lora_in_miniature_matches_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    model = lora_model(n=32, layers=3)
    opt = adapter_optimizer(model)
    train_step(model, opt, 0, n=32)
    assert_same_as_torch(model, [opt])
    count = Counting(monkeypatch)
    train_step(model, opt, 1, n=32)
    assert_same_as_torch(model, [opt])
    assert count.calls == 0


def test_lora_through_peft_matches_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64)
    model = peft.get_peft_model(
        transformers.GPT2LMHeadModel(cfg), peft.LoraConfig(r=8, target_modules=["c_attn"], fan_in_fan_out=True)
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.arange(16).reshape(2, 8)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert_same_as_torch(model, [opt])
    assert plain_state._shapes[model].checked
    count = Counting(monkeypatch)
    assert_same_as_torch(model, [opt])
    assert count.calls == 0


def test_a_changed_tree_goes_to_torch_again(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opts = net_and_optimizers()
    assert_same_as_torch(model, opts)
    count = Counting(monkeypatch)
    changes = [
        lambda: setattr(model.body[3], "bias", nn.Parameter(torch.zeros(16))),  # replaced parameter
        lambda: model.body.append(nn.Linear(16, 16)),  # a new module with parameters
        lambda: model.register_buffer("extra", torch.zeros(2)),  # a new buffer
        lambda: setattr(model, "head", nn.Linear(16, 50)),  # untied: a new module
    ]
    for i, change in enumerate(changes):
        change()
        opts = [torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)]
        net_step(model, opts)
        before = count.calls
        assert_same_as_torch(model, opts)
        assert count.calls == before + 1, i  # a changed tree: ours went to torch
        assert_same_as_torch(model, opts)
        assert count.calls == before + 1, i  # checked again: the fast path


def test_a_state_dict_hook_that_adds_a_key_goes_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opts = net_and_optimizers()
    assert_same_as_torch(model, opts)
    count = Counting(monkeypatch)

    def copy(module, state, prefix, local):
        state[prefix + "scale_copy"] = module.scale.clone()  # a new tensor at every call

    handle = model._register_state_dict_hook(copy)
    for _ in range(2):
        msd, _ = model_and_optim_state(model, opts)
        assert list(msd) == list(get_state_dict(model, opts)[0]) and "scale_copy" in msd
    assert count.calls == 2  # a clone is never the same tensor as torch's: never the fast path
    handle.remove()

    def nested(module, state, prefix, local):
        state[prefix + "body.copy"] = module.scale  # a name torch's walk cannot resolve

    model._register_state_dict_hook(nested)
    with pytest.raises(AttributeError):
        get_state_dict(model, opts)  # torch's own verdict
    with pytest.raises(AttributeError):
        model_and_optim_state(model, opts)  # the same, not a silent success


def test_an_optimizer_without_state_is_initialized_by_torch() -> None:
    model, _ = net_and_optimizers()
    assert_same_as_torch(model, [])  # the model is known to the fast path
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _, osd = model_and_optim_state(model, [opt])
    assert opt.state and set(osd["state"]) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_a_compiled_module_falls_back() -> None:
    model, opts = net_and_optimizers()
    compiled = torch.compile(model)  # an OptimizedModule: keys carry _orig_mod., torch's names do not
    msd, osd = model_and_optim_state(compiled, opts)
    assert compiled not in plain_state._shapes
    assert list(msd) == list(get_state_dict(compiled, opts)[0]) and not any("_orig_mod" in k for k in msd)


def _distributed_checks(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model, opts = net_and_optimizers()
    ddp = DistributedDataParallel(model)
    msd, _ = model_and_optim_state(ddp, opts)
    assert ddp not in plain_state._shapes and not any(k.startswith("module.") for k in msd)
    assert list(msd) == list(get_state_dict(ddp, opts)[0])

    torch.manual_seed(0)
    sharded = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(sharded)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    sharded(torch.ones(2, 8)).sum().backward()
    opt.step()
    for _ in range(2):
        msd, osd = model_and_optim_state(sharded, [opt])
        assert sharded not in plain_state._shapes
        theirs_m, theirs_o = get_state_dict(sharded, [opt])
        assert list(msd) == list(theirs_m) and list(osd["state"]) == list(theirs_o["state"])
        assert all(type(v).__name__ == "DTensor" for v in msd.values())


@pytest.mark.multiproc
def test_ddp_and_fsdp2_fall_back(tmp_path) -> None:
    run_ranks(_distributed_checks, 1, report_dir=tmp_path, timeout=240)
