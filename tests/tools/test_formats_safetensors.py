"""safetensors input is held to the reference library's rules, case by case, and a failed
conversion to safetensors leaves no shard behind."""

from __future__ import annotations

import json
import struct

import pytest
from helpers.samples import flip_byte, item_range, manifest
from safetensors import SafetensorError, safe_open

from goodput_ckpt import CorruptCheckpointError
from goodput_ckpt.storage import open_store
from goodput_ckpt.tools._formats import objects_json, safetensors_file
from goodput_ckpt.tools._formats.safetensors_file import SafetensorsSource, open_safetensors
from goodput_ckpt.tools.ops.convert import convert_checkpoint


def _file(header: dict | str, data: bytes) -> bytes:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _t(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


CASES = {
    "valid": ({"a": _t(), "b": _t(offsets=(8, 16))}, 16),
    "valid_with_metadata": ({"__metadata__": {"format": "pt"}, "a": _t()}, 8),
    "overlapping": ({"a": _t(shape=(4,), offsets=(0, 16)), "b": _t(offsets=(8, 16))}, 16),
    "same_range_twice": ({"a": _t(), "b": _t()}, 8),
    "gap": ({"a": _t(offsets=(8, 16))}, 16),
    "trailing_bytes": ({"a": _t()}, 12),
    "float_shape": ({"a": _t(shape=(2.0,))}, 8),
    "string_shape": ({"a": _t(shape=("2",))}, 8),
    "bool_shape": ({"a": _t(shape=(True, True))}, 8),
    "float_offsets": ({"a": _t(offsets=(0, 8.0))}, 8),
    "bool_offsets": ({"a": _t(shape=(0,), offsets=(False, False))}, 0),
    "string_offsets": ({"a": _t(offsets=("0", "8"))}, 8),
    "negative_shape": ({"a": _t(shape=(-2,), offsets=(0, 8))}, 8),
    "huge_shape": ('{"a": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 8]}}', 8),
    "nan_shape": ('{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}', 8),
    "three_offsets": ({"a": _t(offsets=(0, 8, 8))}, 8),
    "metadata_not_strings": ({"__metadata__": {"n": 1}, "a": _t()}, 8),
    "not_an_object": ("[1, 2]", 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_header_rules_match_the_reference_library(tmp_path, case):
    header, nbytes = CASES[case]
    path = tmp_path / "x.safetensors"
    path.write_bytes(_file(header, bytes(nbytes)))
    try:
        with safe_open(str(path), "pt") as f:
            list(f.keys())
        reference_ok = True
    except (SafetensorError, ValueError, OverflowError):
        reference_ok = False
    assert reference_ok == case.startswith("valid")
    if reference_ok:
        SafetensorsSource(open_store(str(tmp_path)), ["x.safetensors"], None).close()
    else:
        with pytest.raises(CorruptCheckpointError):
            SafetensorsSource(open_store(str(tmp_path)), ["x.safetensors"], None)


def test_index_and_sidecar_over_their_caps_are_refused(sample_ckpt, tmp_path, monkeypatch):
    hf = tmp_path / "hf"
    convert_checkpoint(str(sample_ckpt[0]), str(hf), to="safetensors", shard_size=1 << 16)
    assert (hf / "model.safetensors.index.json").exists()
    monkeypatch.setattr(safetensors_file, "MAX_INDEX_BYTES", 10)
    with pytest.raises(CorruptCheckpointError, match="limit"):
        open_safetensors(open_store(str(hf)), None)
    monkeypatch.undo()
    monkeypatch.setattr(safetensors_file, "MAX_SIDECAR_BYTES", 10)
    with pytest.raises(CorruptCheckpointError, match="sidecar.*limit"):
        open_safetensors(open_store(str(hf)), None)
    assert objects_json.MAX_SIDECAR_BYTES > 10


def test_failed_conversion_leaves_no_shard_behind(ckpt, tmp_path):
    # A tensor written after others (objects are decoded first), so shards exist when it fails.
    key = "optimizer.state.embed.weight.exp_avg"
    tensors = [k for k, v in manifest(ckpt)["items"].items() if v["kind"] == "tensor"]
    assert tensors.index(key) > 0
    f, off, _ = item_range(ckpt, key)
    flip_byte(ckpt, f, off + 1)
    out = tmp_path / "hf"
    with pytest.raises(CorruptCheckpointError) as info:
        convert_checkpoint(str(ckpt), str(out), to="safetensors", shard_size=1)
    assert key in info.value.key.split(", ")  # the message may shorten a long key list
    assert sorted(p.name for p in out.iterdir()) == [] if out.exists() else True
