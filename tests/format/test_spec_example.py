"""docs/format.md is a spec a reader can be written from: its examples run, and its tables say
what the code does.

- The reader example reads what CheckpointWriter wrote, bfloat16, bool and float8 included, and
  refuses a manifest whose digest fails.
- The example manifest is a real one: written compactly, its digest checks and parse_manifest
  accepts it.
- The element-size table and the limits table agree with the validator (limits by behaviour:
  the value at a limit is accepted, one past it refused).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointError, CheckpointWriter, CorruptCheckpointError
from goodput_ckpt.format import DTYPE_SIZES, parse_manifest
from goodput_ckpt.format.manifest import seal_manifest

SPEC = Path(__file__).resolve().parents[2] / "docs" / "format.md"


def _block(lang: str, index: int) -> str:
    blocks = re.findall(rf"```{lang}\n(.*?)```", SPEC.read_text(), flags=re.S)
    assert blocks, f"docs/format.md lost its {lang} example"
    return blocks[index]


def _spec_reader() -> dict:
    namespace: dict = {}
    exec(compile(_block("python", -1), str(SPEC), "exec"), namespace)  # noqa: S102 - our own doc
    return namespace


def _section(title: str) -> str:
    m = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ )", SPEC.read_text(), flags=re.S | re.M)
    assert m, f"docs/format.md lost its section {title!r}"
    return m.group(1)


def test_spec_example_reads_a_checkpoint(tmp_path):
    read_tensor = _spec_reader()["read_tensor"]
    g = torch.Generator().manual_seed(0)
    sd = {
        "w": torch.randn(300, 70, generator=g),
        "i": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "s": torch.tensor(2.5),
        "bf": torch.randn(33, 5, generator=g).to(torch.bfloat16),
        "h": torch.randn(17, generator=g).half(),
        "mask": torch.rand(29, generator=g) > 0.5,
        "c": torch.randn(6, dtype=torch.complex64, generator=g),
        "f8": torch.randn(40, generator=g).to(torch.float8_e4m3fn),
    }
    dcp.save(sd, storage_writer=CheckpointWriter(tmp_path, chunk_size=1 << 12))
    for key in ("w", "i", "s", "h", "mask", "c"):
        np.testing.assert_array_equal(read_tensor(str(tmp_path), key), sd[key].numpy())
    bf = read_tensor(str(tmp_path), "bf")
    assert bf.dtype == np.float32
    np.testing.assert_array_equal(bf, sd["bf"].float().numpy())  # widening bfloat16 is exact
    np.testing.assert_array_equal(read_tensor(str(tmp_path), "f8"), sd["f8"].view(torch.uint8).numpy())  # raw bits


def test_spec_example_refuses_a_damaged_manifest(tmp_path):
    read_manifest = _spec_reader()["read_manifest"]
    dcp.save({"w": torch.ones(8)}, storage_writer=CheckpointWriter(tmp_path))
    raw = (tmp_path / "manifest.json").read_bytes()
    assert read_manifest(str(tmp_path))["world_size"] == 1
    (tmp_path / "manifest.json").write_bytes(raw.replace(b'"world_size":1', b'"world_size":3'))
    with pytest.raises(AssertionError):
        read_manifest(str(tmp_path))


def test_the_example_numpy_types_have_the_spec_element_sizes():
    numpy_types = _spec_reader()["NUMPY"]
    assert set(numpy_types) == set(DTYPE_SIZES)
    assert {k: np.dtype(v).itemsize for k, v in numpy_types.items()} == DTYPE_SIZES


def test_element_type_table_is_the_code_table():
    table: dict[str, int] = {}
    for row in re.findall(r"^\| (`.*?) \| ([\d, ]+) \|", _section("Element types"), flags=re.M):
        names, sizes = re.findall(r"`(\w+)`", row[0]), [int(x) for x in row[1].split(",")]
        assert len(names) == len(sizes) or len(sizes) == 1, row
        table.update(zip(names, sizes if len(sizes) == len(names) else sizes * len(names)))
    assert table == DTYPE_SIZES
    assert all(getattr(torch, n).itemsize == s for n, s in table.items() if hasattr(torch, n))


def _example_doc() -> dict:
    return json.loads(_block("json", 0))


def _sealed(doc: dict) -> bytes:
    body = {k: v for k, v in doc.items() if k != "digest"}
    return seal_manifest(json.dumps(body, separators=(",", ":")).encode("utf-8"))


def test_example_manifest_is_a_real_one():
    doc = _example_doc()
    raw = _sealed(doc)
    assert json.loads(raw)["digest"] == doc["digest"], "the example, written compactly, is not the file it came from"
    m = parse_manifest(raw)
    assert m.items["model.w"].dtype == "bfloat16" and m.world_size == 1 and m.chunk_size == 4096
    assert m.dcp["planner_data"]["optim.param_groups.0.lr"] == ["optim", "param_groups", 0, "lr"]


def test_optional_members_have_the_documented_defaults():
    doc = _example_doc()
    for name in ("library_version", "torch_version", "created_at", "byte_order", "dcp", "metadata"):
        del doc[name]
    del doc["items"]["model.w"]["requires_grad"]
    m = parse_manifest(_sealed(doc))
    assert (m.library_version, m.torch_version, m.created_at, m.dcp, m.metadata) == ("", "", "", {}, {})
    assert m.items["model.w"].requires_grad is False
    for name in ("format", "version", "world_size", "hash", "files", "items"):
        broken = _example_doc()
        del broken[name]
        with pytest.raises(CheckpointError):
            parse_manifest(_sealed(broken))


def _limit_row(label: str) -> str:
    for row in re.findall(r"^\| (.*?) \| (.*?) \|$", _section("Limits"), flags=re.M):
        if row[0].startswith(label):
            return row[1]
    raise AssertionError(f"the Limits table lost its row {label!r}")


def _accepts(edit) -> bool:
    doc = _example_doc()
    edit(doc)
    try:
        parse_manifest(_sealed(doc))
    except CorruptCheckpointError:
        return False
    return True


def test_limits_table_is_what_the_validator_enforces():
    assert "2^24" in _limit_row("world size")
    assert _accepts(lambda d: d.update(world_size=1 << 24)) and not _accepts(
        lambda d: d.update(world_size=(1 << 24) + 1)
    )
    assert not _accepts(lambda d: d.update(world_size=0))

    assert "64" in _limit_row("dimensions per tensor")

    def ndim(n):
        def edit(d):
            w = d["items"]["model.w"]
            w["shape"] = [4, 3] + [1] * (n - 2)
            w["grid"]["block"] = [4, 3] + [1] * (n - 2)

        return edit

    assert _accepts(ndim(64)) and not _accepts(ndim(65))

    assert "2^12" in _limit_row("hash chunk size") and "2^30" in _limit_row("hash chunk size")
    # A larger chunk size means fewer digests; one digest covers the example's whole file either way.
    assert _accepts(lambda d: d["hash"].update(chunk_size=1 << 30))
    assert not _accepts(lambda d: d["hash"].update(chunk_size=(1 << 30) + 1))
    assert not _accepts(lambda d: d["hash"].update(chunk_size=(1 << 12) - 1))

    assert "2^50" in _limit_row("file size")
    file = next(iter(_example_doc()["files"]))
    assert not _accepts(lambda d: d["files"][file].update(size=(1 << 50) + 1))

    assert "2^30" in _limit_row("manifest size")

    assert "2^27" in _limit_row("grid cells")

    class _Huge(bytes):  # its length alone is over the limit, without allocating a GiB
        def __len__(self) -> int:
            return (1 << 30) + 1

    with pytest.raises(CorruptCheckpointError, match="limit"):
        parse_manifest(_Huge(b"{}"))

    assert "64" in _limit_row("item alignment")
    assert not _accepts(lambda d: d["items"]["step"].update(offset=2624 - 8))  # in the file, after the item before
