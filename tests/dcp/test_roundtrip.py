"""Single-process round trips through dcp.save/dcp.load with CheckpointWriter/CheckpointReader."""

from __future__ import annotations

import json
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.trees import assert_tree_equal, zeros_like

from goodput_ckpt import CheckpointError, CheckpointExistsError, CheckpointReader, CheckpointWriter
from goodput_ckpt.format import MANIFEST_NAME

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
] + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64") if hasattr(torch, n)]


def _random(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=gen)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)


def _save_load(sd, path, dest=None, **writer_kw):
    dcp.save(sd, storage_writer=CheckpointWriter(path, **writer_kw))
    dest = zeros_like(sd) if dest is None else dest
    dcp.load(dest, storage_reader=CheckpointReader(path))
    return dest


def test_all_dtypes_nested_and_objects(ckpt_dir):
    gen = torch.Generator().manual_seed(0)
    sd = {
        "model": {f"w_{str(dt).removeprefix('torch.')}": _random((7, 5), dt, gen) for dt in DTYPES},
        "scalar": torch.tensor(3.25),
        "scalar_int": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "empty3d": torch.empty(3, 0, 2, dtype=torch.bfloat16),
        "noncontig": torch.randn(16, 8, generator=gen).t(),
        "strided": torch.randn(10, 10, generator=gen)[::2, 1::3],
        "expanded": torch.randn(1, 6, generator=gen).expand(4, 6),
        "step": 123,
        "name": "run-7",
        "cfg": {"lr": 0.001, "betas": [0.9, 0.95], "nested": {"flag": True, "none": None}},
    }
    dest = zeros_like(sd)
    # The destination holds none of the plain values, so only a reader that loads objects passes.
    assert (dest["step"], dest["name"], dest["cfg"]["lr"], dest["cfg"]["betas"], dest["cfg"]["nested"]["flag"]) == (
        0,
        "",
        0.0,
        [],
        False,
    )
    got = _save_load(sd, ckpt_dir, dest)
    assert got is dest
    assert_tree_equal(got, sd)


def test_bit_exact_float_specials(ckpt_dir):
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3.4e38])
    got = _save_load({"t": t, "b": t.to(torch.bfloat16)}, ckpt_dir)
    assert torch.equal(got["t"].view(torch.int32), t.view(torch.int32))
    assert torch.equal(got["b"].view(torch.int16), t.to(torch.bfloat16).view(torch.int16))


def test_many_small_and_large_tensors(ckpt_dir):
    gen = torch.Generator().manual_seed(1)
    sd = {f"small.{i}": torch.randn(i % 17 + 1, generator=gen) for i in range(600)}
    sd["large"] = torch.randn(9 << 20, generator=gen)  # 36 MiB: spans several hash chunks
    sd["odd"] = torch.randn(1_000_003, generator=gen).to(torch.float16)
    got = _save_load(sd, ckpt_dir, chunk_size=1 << 20)  # 1 MiB chunks: items straddle chunks
    assert_tree_equal(got, sd)
    manifest = json.loads((ckpt_dir / MANIFEST_NAME).read_bytes())
    assert manifest["hash"]["chunk_size"] == 1 << 20
    (f,) = manifest["files"].values()
    assert len(f["chunks"]) == -(-f["size"] // (1 << 20))


@pytest.mark.parametrize("files_per_rank,thread_count", [(1, 1), (3, 2), (8, 4)])
def test_files_per_rank_and_threads(ckpt_dir, files_per_rank, thread_count):
    gen = torch.Generator().manual_seed(2)
    sd = {f"t{i}": torch.randn(1000 * (i + 1), generator=gen) for i in range(12)}
    got = _save_load(sd, ckpt_dir, files_per_rank=files_per_rank, thread_count=thread_count, chunk_size=1 << 16)
    assert_tree_equal(got, sd)
    data_files = [n for n in os.listdir(ckpt_dir) if n.endswith(".bin")]
    assert len(data_files) == files_per_rank


def test_load_into_other_dtype_and_device_layout(ckpt_dir):
    """Destinations that are not byte-compatible go through a staging buffer and copy_()."""
    sd = {"w": torch.randn(32, 16)}
    dcp.save(sd, storage_writer=CheckpointWriter(ckpt_dir))
    dest_nc = {"w": torch.zeros(16, 32).t()}  # non-contiguous destination
    dcp.load(dest_nc, storage_reader=CheckpointReader(ckpt_dir))
    assert torch.equal(dest_nc["w"], sd["w"])
    dest_f64 = {"w": torch.zeros(32, 16, dtype=torch.float64)}
    dcp.load(dest_f64, storage_reader=CheckpointReader(ckpt_dir))
    assert torch.equal(dest_f64["w"], sd["w"].double())


def test_partial_load_reads_subset(ckpt_dir):
    sd = {"a": torch.randn(100), "b": torch.randn(200)}
    dcp.save(sd, storage_writer=CheckpointWriter(ckpt_dir))
    dest = {"b": torch.zeros(200)}
    dcp.load(dest, storage_reader=CheckpointReader(ckpt_dir))
    assert torch.equal(dest["b"], sd["b"])


def test_verify_false_roundtrip(ckpt_dir):
    sd = {"a": torch.randn(5000), "n": 3}
    dcp.save(sd, storage_writer=CheckpointWriter(ckpt_dir))
    dest = {"a": torch.zeros(5000), "n": 0}
    dcp.load(dest, storage_reader=CheckpointReader(ckpt_dir, verify=False))
    assert torch.equal(dest["a"], sd["a"]) and dest["n"] == 3


def test_checkpoint_id_and_reset(tmp_path):
    writer = CheckpointWriter(tmp_path / "unused")
    reader = CheckpointReader(tmp_path / "unused")
    for step in (1, 2):
        sd = {"w": torch.full((4,), float(step))}
        dcp.save(sd, checkpoint_id=tmp_path / f"step{step}", storage_writer=writer)
    for step in (1, 2):
        dest = {"w": torch.zeros(4)}
        dcp.load(dest, checkpoint_id=tmp_path / f"step{step}", storage_reader=reader)
        assert torch.equal(dest["w"], torch.full((4,), float(step)))
    assert not (tmp_path / "unused").exists()


def test_file_url(tmp_path):
    uri = (tmp_path / "c").as_uri()
    got = _save_load({"x": torch.arange(10)}, uri)
    assert torch.equal(got["x"], torch.arange(10))


def test_existing_checkpoint_refused_then_overwritten(ckpt_dir):
    dcp.save({"x": torch.zeros(3)}, storage_writer=CheckpointWriter(ckpt_dir))
    with pytest.raises(BaseException) as info:
        dcp.save({"x": torch.ones(3)}, storage_writer=CheckpointWriter(ckpt_dir))
    from goodput_ckpt.errors import find_checkpoint_error

    assert isinstance(find_checkpoint_error(info.value), CheckpointExistsError)
    dcp.save({"x": torch.ones(3)}, storage_writer=CheckpointWriter(ckpt_dir, overwrite=True))
    dest = {"x": torch.zeros(3)}
    dcp.load(dest, storage_reader=CheckpointReader(ckpt_dir))
    assert torch.equal(dest["x"], torch.ones(3))
    assert len([n for n in os.listdir(ckpt_dir) if n.endswith(".bin")]) == 1, "old data files removed"


def test_unsafe_object_needs_opt_in(ckpt_dir):
    class Custom:
        def __init__(self):
            self.v = 5

        def __eq__(self, other):
            return isinstance(other, Custom) and other.v == self.v

    globals()["Custom"] = Custom  # picklable by reference
    Custom.__qualname__ = "Custom"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save({"c": Custom()}, storage_writer=CheckpointWriter(ckpt_dir))
    assert any("weights_only" in str(w.message) for w in caught)
    dest = {"c": None}
    with pytest.raises(BaseException) as info:
        dcp.load(dest, storage_reader=CheckpointReader(ckpt_dir))
    assert "trust_pickle" in str(info.value)
    dcp.load(dest, storage_reader=CheckpointReader(ckpt_dir, trust_pickle=True))
    assert dest["c"] == Custom()


def test_writer_pickles_cleanly(ckpt_dir):
    w = CheckpointWriter(ckpt_dir, thread_count=3, metadata={"a": 1})
    w2 = pickle.loads(pickle.dumps(w))
    assert w2.thread_count == 3 and w2.user_metadata == {"a": 1}
    dcp.save({"x": torch.arange(4)}, storage_writer=w2)
    assert (ckpt_dir / MANIFEST_NAME).exists()


def test_user_metadata_in_manifest(ckpt_dir):
    dcp.save({"x": torch.arange(4)}, storage_writer=CheckpointWriter(ckpt_dir, metadata={"step": 10, "tag": "a"}))
    assert CheckpointReader(ckpt_dir).manifest.metadata == {"step": 10, "tag": "a"}


def test_bad_arguments():
    with pytest.raises(TypeError, match="unknown option"):
        CheckpointWriter("/tmp/x", not_an_option=1)
    with pytest.raises(ValueError):
        CheckpointWriter("/tmp/x", thread_count=0)
    with pytest.raises(ValueError):
        CheckpointWriter("/tmp/x", chunk_size=10)
    with pytest.raises(ValueError, match="JSON"):
        CheckpointWriter("/tmp/x", metadata={"a": object()})
    with pytest.raises(ValueError, match="unsupported checkpoint URI"):
        CheckpointReader("gopher://x/y")
    assert CheckpointWriter.validate_checkpoint_id("/a/b")
    assert not CheckpointWriter.validate_checkpoint_id("gopher://x")


def test_overlapping_saves_on_one_writer_raise(ckpt_dir):
    import threading

    w = CheckpointWriter(ckpt_dir)
    w.set_up_storage_writer(True)
    errors = []

    def other():
        try:
            w.set_up_storage_writer(True)
        except CheckpointError as e:
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "already running" in str(errors[0])


def test_manifest_sharing_default_depends_on_request_cost(tmp_path):
    """Ranks share one manifest read on object stores only, so a partial load from local disk
    (dcp.load(..., no_dist=True) on some ranks) never waits on a broadcast."""
    assert CheckpointReader(tmp_path)._shares_manifest() is False
    assert CheckpointReader(tmp_path, share_manifest=True)._shares_manifest() is True
    s3 = CheckpointReader("s3://bucket/run/step_1", endpoint_url="http://127.0.0.1:9")
    assert s3._shares_manifest() is True
    assert (
        CheckpointReader("s3://bucket/x", share_manifest=False, endpoint_url="http://127.0.0.1:9")._shares_manifest()
        is False
    )
