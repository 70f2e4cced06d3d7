"""convert_checkpoint between goodput, torch DCP, torch.save and safetensors: exact tensors,
objects through every format, detection, trust, damaged inputs and existing outputs."""

from __future__ import annotations

import json
import pickle

import pytest
import safetensors.torch as st
import torch
import torch.distributed.checkpoint as dcp
from helpers.samples import (
    Evil,
    Opaque,
    flat_tensors,
    flip_byte,
    item_range,
    manifest,
    sample_state,
    save,
)
from helpers.trees import assert_tree_equal, zeros_like
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from goodput_ckpt import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointReader,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from goodput_ckpt.format import MANIFEST_NAME
from goodput_ckpt.tools.ops.convert import convert_checkpoint, detect_format
from goodput_ckpt.tools.ops.verify import verify_checkpoint


def _load_ours(path, like):
    dest = zeros_like(like)
    dcp.load(dest, storage_reader=CheckpointReader(str(path)))
    return dest


def test_round_trip_ours_dcp_ours_safetensors_is_exact(sample_ckpt, tmp_path):
    src, sd = sample_ckpt
    d, ours2, sft = tmp_path / "dcp", tmp_path / "ours2", tmp_path / "st"
    r = convert_checkpoint(str(src), str(d), to="dcp")
    assert (r.src_format, r.dst_format, r.tensors, r.objects) == ("goodput", "dcp", len(flat_tensors(sd)), 5)
    via_fs = zeros_like(sd)
    dcp.load(via_fs, storage_reader=FileSystemReader(str(d)))  # torch's own reader
    assert_tree_equal(via_fs, sd)

    r = convert_checkpoint(str(d), str(ours2), to="goodput")
    assert r.src_format == "dcp" and verify_checkpoint(str(ours2)).ok
    assert manifest(ours2)["metadata"]["goodput_convert"]["from_format"] == "dcp"
    assert_tree_equal(_load_ours(ours2, sd), sd)

    r = convert_checkpoint(str(ours2), str(sft), to="safetensors")
    assert r.files == ["model.safetensors", "model.objects.json"]
    tensors = st.load_file(str(sft / "model.safetensors"))
    want = flat_tensors(sd)
    assert set(tensors) == set(want)
    for k, t in want.items():
        assert_tree_equal(tensors[k], t, k)
    side = json.loads((sft / "model.objects.json").read_text())
    assert side["objects"]["optimizer.param_groups.0.betas"] == {"$tuple": [0.9, 0.95]}
    assert side["objects"]["extra.name"] == "run-7"


def test_safetensors_back_to_ours_and_dcp_restores_objects_and_nesting(sample_ckpt, tmp_path):
    src, sd = sample_ckpt
    one = tmp_path / "one.safetensors"
    convert_checkpoint(str(src), str(one), to="safetensors")
    assert (tmp_path / "one.objects.json").exists()
    assert detect_format(str(one)) == "safetensors"
    convert_checkpoint(str(one), str(tmp_path / "back"), to="goodput")
    assert_tree_equal(_load_ours(tmp_path / "back", sd), sd)
    convert_checkpoint(str(one), str(tmp_path / "back.dcp"), to="dcp")
    got = zeros_like(sd)
    dcp.load(got, storage_reader=FileSystemReader(str(tmp_path / "back.dcp")))
    assert_tree_equal(got, sd)


def test_hf_shards_with_index(sample_ckpt, tmp_path):
    src, sd = sample_ckpt
    out = tmp_path / "hf"
    r = convert_checkpoint(str(src), str(out), to="safetensors", shard_size=200_000)
    shards = [f for f in r.files if f.endswith(".safetensors")]
    assert len(shards) >= 3 and "model.safetensors.index.json" in r.files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    want = flat_tensors(sd)
    assert set(index["weight_map"]) == set(want) and index["metadata"]["total_size"] == sum(
        t.nbytes for t in want.values()
    )
    merged = {}
    for s in shards:
        merged.update(st.load_file(str(out / s)))
    for k, t in want.items():
        assert_tree_equal(merged[k], t, k)
    convert_checkpoint(str(out), str(tmp_path / "back"), to="goodput")
    assert_tree_equal(_load_ours(tmp_path / "back", sd), sd)
    # A plain HF directory written by safetensors itself, without our sidecar.
    plain = tmp_path / "plain"
    plain.mkdir()
    st.save_file({"a": torch.arange(6.0).reshape(2, 3)}, str(plain / "model-00001-of-00002.safetensors"))
    st.save_file({"b": torch.ones(4, dtype=torch.int8)}, str(plain / "model-00002-of-00002.safetensors"))
    (plain / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {},
                "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
            }
        )
    )
    convert_checkpoint(str(plain), str(tmp_path / "plain-ours"), to="goodput")
    got = _load_ours(tmp_path / "plain-ours", {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.int8)})
    assert torch.equal(got["a"], torch.arange(6.0).reshape(2, 3)) and torch.equal(
        got["b"], torch.ones(4, dtype=torch.int8)
    )


def test_torch_save_both_ways(sample_ckpt, tmp_path):
    src, sd = sample_ckpt
    pt = tmp_path / "model.pt"
    convert_checkpoint(str(src), str(pt), to="torch")
    loaded = torch.load(pt, weights_only=True)
    assert_tree_equal(loaded, sd)  # nesting, tuples and every dtype come back
    # A torch.save file from elsewhere: views into one storage and a non-contiguous tensor.
    base = torch.arange(60.0).reshape(6, 10)
    state = {"model": {"top": base[:3], "cols": base[:, 2:5], "t": base.t(), "n": torch.tensor(3)}, "note": "x"}
    theirs = tmp_path / "theirs.pt"
    torch.save(state, theirs)
    assert detect_format(str(theirs)) == "torch"
    convert_checkpoint(str(theirs), str(tmp_path / "t-ours"), to="goodput")
    assert_tree_equal(_load_ours(tmp_path / "t-ours", state), state)
    legacy = tmp_path / "legacy.pt"
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    assert detect_format(str(legacy)) == "torch"
    convert_checkpoint(str(legacy), str(tmp_path / "l-ours"), to="goodput")
    assert_tree_equal(_load_ours(tmp_path / "l-ours", state), state)


def test_trust_pickle_is_opt_in(tmp_path):
    state = {"model": {"w": torch.ones(3)}, "opaque": Opaque(5)}
    pt = tmp_path / "custom.pt"
    torch.save(state, pt)
    with pytest.raises(CheckpointError, match="trust-pickle"):
        convert_checkpoint(str(pt), str(tmp_path / "a"), to="goodput")
    assert not (tmp_path / "a" / MANIFEST_NAME).exists()
    convert_checkpoint(str(pt), str(tmp_path / "b"), to="goodput", trust_pickle=True)
    dest = {"model": {"w": torch.zeros(3)}, "opaque": None}
    dcp.load(dest, storage_reader=CheckpointReader(str(tmp_path / "b"), trust_pickle=True))
    assert dest["opaque"] == Opaque(5) and torch.equal(dest["model"]["w"], torch.ones(3))


def test_hostile_dcp_metadata_is_refused_not_run(tmp_path, sample_ckpt):
    d = tmp_path / "dcp"
    convert_checkpoint(str(sample_ckpt[0]), str(d), to="dcp")
    marker = tmp_path / "pwned"
    (d / ".metadata").write_bytes(pickle.dumps(Evil(str(marker))))
    with pytest.raises(CheckpointError, match="trust-pickle"):
        convert_checkpoint(str(d), str(tmp_path / "out"), to="goodput")
    assert not marker.exists()


def test_dcp_input_from_torch_writer_and_multi_chunk_tensors(sample_ckpt, tmp_path):
    from goodput_ckpt.storage import open_store
    from goodput_ckpt.tools._formats.dcp_fs import DcpSource, write_dcp
    from goodput_ckpt.tools._formats.goodput import GoodputSource

    src, sd = sample_ckpt
    fsw = tmp_path / "fsw"
    dcp.save(sd, storage_writer=FileSystemWriter(str(fsw), thread_count=2))
    assert detect_format(str(fsw)) == "dcp"
    convert_checkpoint(str(fsw), str(tmp_path / "from-fsw"), to="goodput")
    assert_tree_equal(_load_ours(tmp_path / "from-fsw", sd), sd)
    # Shards saved as views: one with a storage offset (read in place), one strided (decoded).
    base = torch.arange(120.0).reshape(10, 12)
    views = {"t": base.t(), "v": base[2:4], "w": base}
    dcp.save(views, storage_writer=FileSystemWriter(str(tmp_path / "views")))
    convert_checkpoint(str(tmp_path / "views"), str(tmp_path / "views-ours"), to="goodput")
    assert_tree_equal(_load_ours(tmp_path / "views-ours", views), {k: v.contiguous() for k, v in views.items()})
    # Tensors stored as many row-block chunks (as a sharded DCP save would) read back exactly.
    blocks = tmp_path / "blocks"
    with GoodputSource(open_store(str(src))) as source:
        write_dcp(source, open_store(str(blocks)), overwrite=False, thread_count=3, block_bytes=1000)
    with DcpSource(open_store(str(blocks))) as s:
        assert len(s.boxes("model.embed.weight")) > 100
    got = zeros_like(sd)
    dcp.load(got, storage_reader=FileSystemReader(str(blocks)))
    assert_tree_equal(got, sd)
    convert_checkpoint(str(blocks), str(tmp_path / "blocks-ours"), to="goodput")
    assert_tree_equal(_load_ours(tmp_path / "blocks-ours", sd), sd)


def test_detection(sample_ckpt, tmp_path):
    src = sample_ckpt[0]
    assert detect_format(str(src)) == "goodput"
    assert detect_format(f"file://{src}") == "goodput"
    with pytest.raises(CheckpointNotFoundError):
        detect_format(str(tmp_path / "none"))
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "rank00000-00.0123456789ab.bin").write_bytes(b"x")
    with pytest.raises(IncompleteCheckpointError):
        detect_format(str(inc))
    with pytest.raises(IncompleteCheckpointError):
        convert_checkpoint(str(inc), str(tmp_path / "o"), to="dcp")
    inc2 = tmp_path / "inc2"
    inc2.mkdir()
    (inc2 / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(IncompleteCheckpointError):
        detect_format(str(inc2))
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello world, not a checkpoint")
    with pytest.raises(CheckpointError, match="neither"):
        detect_format(str(junk))


def test_corrupt_input_writes_no_output(ckpt, tmp_path):
    f, off, _ = item_range(ckpt, "model.layer.weight")
    flip_byte(ckpt, f, off + 1)
    for to, dst in (
        ("dcp", tmp_path / "d"),
        ("safetensors", tmp_path / "s.safetensors"),
        ("torch", tmp_path / "t.pt"),
        ("goodput", tmp_path / "g"),
    ):
        with pytest.raises(CorruptCheckpointError, match="model.layer.weight"):
            convert_checkpoint(str(ckpt), str(dst), to=to)
    assert not (tmp_path / "d" / ".metadata").exists() and not (tmp_path / "g" / MANIFEST_NAME).exists()
    assert not (tmp_path / "t.pt").exists() and not (tmp_path / "s.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".t.pt")]  # no temporary left behind


def test_existing_outputs_need_overwrite(sample_ckpt, tmp_path):
    src, sd = sample_ckpt
    for to, dst in (
        ("dcp", tmp_path / "d"),
        ("safetensors", tmp_path / "s.safetensors"),
        ("safetensors", tmp_path / "hf"),
        ("torch", tmp_path / "t.pt"),
        ("goodput", tmp_path / "g"),
    ):
        convert_checkpoint(str(src), str(dst), to=to)
        with pytest.raises(CheckpointExistsError):
            convert_checkpoint(str(src), str(dst), to=to)
        convert_checkpoint(str(src), str(dst), to=to, overwrite=True)
    assert_tree_equal(torch.load(tmp_path / "t.pt", weights_only=True), sd)
    with pytest.raises(ValueError, match="differ"):
        convert_checkpoint(str(src), str(src), to="goodput")
    with pytest.raises(ValueError):
        convert_checkpoint(str(src), str(tmp_path / "x"), to="onnx")
    with pytest.raises(ValueError):
        convert_checkpoint(str(src), str(tmp_path / "x"), to="dcp", shard_size=100)


def test_values_a_format_cannot_hold_fail_before_writing(tmp_path):
    path = tmp_path / "c"
    save(path, {"model": {"z": torch.randn(3, dtype=torch.complex128)}})
    with pytest.raises(CheckpointError, match="complex128"):
        convert_checkpoint(str(path), str(tmp_path / "o.safetensors"), to="safetensors")
    assert not list(tmp_path.glob("o.*"))
    path2 = tmp_path / "c2"
    save(path2, {"model": {"w": torch.ones(2)}, "odd": {1, 2}})
    with pytest.raises(CheckpointError, match="odd"):
        convert_checkpoint(str(path2), str(tmp_path / "p.safetensors"), to="safetensors")
    assert not list(tmp_path.glob("p.*"))


def test_sidecar_encoding_round_trips():
    from goodput_ckpt.tools._formats.objects_json import decode_value, encode_value

    value = {
        "t": (1, 2.5, "x", None, True),
        "nonstr": {1: "a", (2, 3): "b"},
        "dollar": {"$x": 1},
        "floats": [float("inf"), float("-inf")],
        "bytes": b"\x00\xff",
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "small": torch.arange(4, dtype=torch.int16).reshape(2, 2),
        "big": 2**70,
    }
    doc = json.loads(json.dumps(encode_value(value, "k"), allow_nan=False))
    back = decode_value(doc, "k")
    small = back.pop("small")
    assert torch.equal(small, value["small"]) and small.dtype == torch.int16
    want = dict(value)
    del want["small"]
    assert back == want
    nan = decode_value(encode_value(float("nan"), "k"), "k")
    assert nan != nan


def test_sample_objects_survive_every_format(sample_ckpt, tmp_path):
    src, sd = sample_ckpt
    assert sample_state()["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    for to, dst in (("torch", tmp_path / "a.pt"), ("safetensors", tmp_path / "b.safetensors"), ("dcp", tmp_path / "c")):
        convert_checkpoint(str(src), str(dst), to=to)
        back = tmp_path / f"{dst.name}-back"
        convert_checkpoint(str(dst), str(back), to="goodput")
        got = _load_ours(back, sd)
        assert got["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95), to
        assert got["extra"] == {"epoch": 3, "name": "run-7"}, to
