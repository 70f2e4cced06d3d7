"""dcp/read_items.py: what one read item needs, and the one rule for decoding stored values."""

from __future__ import annotations

import io

import pytest
import torch
from helpers.samples import Opaque

from goodput_ckpt.dcp.read_items import c_strides, decode_object, load_value
from goodput_ckpt.errors import CheckpointError


def _saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def test_c_strides_count_a_zero_size_dim_as_one():
    assert c_strides((4, 3, 2)) == (6, 2, 1)
    assert c_strides((5, 0, 2)) == (2, 2, 1)
    assert c_strides(()) == ()


def test_a_refused_value_names_the_callers_opt_in():
    raw = _saved(Opaque(3))
    with pytest.raises(CheckpointError, match=r"weights_only=True .*pass --my-flag\.$") as e:
        load_value(raw, "extra.x", trust_pickle=False, opt_in="--my-flag")
    assert e.value.key == "extra.x"
    assert load_value(raw, "extra.x", trust_pickle=True, opt_in="--my-flag") == Opaque(3)


def test_the_reader_hands_the_planner_only_allow_listed_bytes():
    """An allowed value comes back re-serialized; a refused one names the reader's opt-in; a
    trusted one is passed through as stored."""
    out = decode_object("step", _saved({"n": 7}), trust_pickle=False)
    assert torch.load(out, weights_only=True) == {"n": 7}
    with pytest.raises(CheckpointError, match=r"CheckpointReader\(\.\.\., trust_pickle=True\)"):
        decode_object("x", _saved(Opaque(1)), trust_pickle=False)
    raw = _saved(Opaque(1))
    assert decode_object("x", raw, trust_pickle=True).getvalue() == raw
