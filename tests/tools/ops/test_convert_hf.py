"""A CheckpointManager checkpoint becomes a Hugging Face model (issue 20, item 1).

Uses a real transformers GPT-2 built from a config (no download) and a real optimizer step,
so the checkpoint holds model, optimizer, RNG and loader state the way training writes it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from goodput_ckpt import CheckpointManager
from goodput_ckpt.cli import main
from goodput_ckpt.tools.ops.convert import convert_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _trained_gpt2(root):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=101, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # tied
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(torch.randint(0, 101, (2, 8)), labels=torch.randint(0, 101, (2, 8))).loss
    loss.backward()
    opt.step()
    with CheckpointManager(str(root), async_save=False) as mgr:
        mgr.save(7, model=model, optimizer=opt)
    return model, config


def _load(out, config):
    config.save_pretrained(out)  # writes config.json
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    return loaded, info


def _assert_same(model, loaded, info):
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def _header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def test_cli_default_exports_the_model_for_from_pretrained(tmp_path, capsys):
    model, config = _trained_gpt2(tmp_path / "ckpt")
    out = tmp_path / "hf"
    assert main(["convert", str(tmp_path / "ckpt" / "step_00000007"), str(out), "--to", "safetensors"]) == 0
    assert "model alone" in capsys.readouterr().out
    header = _header(out / "model.safetensors")
    assert header["__metadata__"] == {"format": "pt"}
    keys = set(header) - {"__metadata__"}
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys  # tied: written once
    assert not any(k.startswith(("model.", "optimizer.", "rng.")) for k in keys)
    loaded, info = _load(out, config)
    _assert_same(model, loaded, info)


def test_explicit_keys_and_strip_prefix_match_the_default(tmp_path):
    model, config = _trained_gpt2(tmp_path / "ckpt")
    step = str(tmp_path / "ckpt" / "step_00000007")
    r = convert_checkpoint(step, str(tmp_path / "hf"), to="safetensors", keys=["model.*"], strip_prefix="model.")
    assert r.selection == "keys" and r.tied_dropped == ["model.lm_head.weight"]
    loaded, info = _load(tmp_path / "hf", config)
    _assert_same(model, loaded, info)


def test_all_keeps_every_key(tmp_path):
    _trained_gpt2(tmp_path / "ckpt")
    step = str(tmp_path / "ckpt" / "step_00000007")
    r = convert_checkpoint(step, str(tmp_path / "all"), to="safetensors", select="all")
    keys = set(_header(tmp_path / "all" / "model.safetensors")) - {"__metadata__"}
    assert r.selection == "all" and "model.lm_head.weight" in keys and any(k.startswith("optimizer.") for k in keys)


def test_equal_but_untied_tensors_are_both_written(tmp_path):
    """Zero-initialised biases are equal bytes, not one tensor: only saved ties are dropped."""
    model, config = _trained_gpt2(tmp_path / "ckpt")
    with torch.no_grad():
        model.transformer.h[0].ln_1.bias.zero_()
        model.transformer.h[1].ln_1.bias.zero_()
    with CheckpointManager(str(tmp_path / "ckpt2"), async_save=False) as mgr:
        mgr.save(1, model=model)
    r = convert_checkpoint(str(tmp_path / "ckpt2" / "step_00000001"), str(tmp_path / "hf"), to="safetensors")
    assert r.tied_dropped == ["model.lm_head.weight"]
    loaded, info = _load(tmp_path / "hf", config)
    _assert_same(model, loaded, info)


def test_shard_size_with_a_single_file_destination_is_refused(tmp_path):
    _trained_gpt2(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="single .safetensors file"):
        convert_checkpoint(
            str(tmp_path / "ckpt" / "step_00000007"), str(tmp_path / "m.safetensors"), to="safetensors", shard_size=1000
        )
    assert not os.path.exists(tmp_path / "m.safetensors")
