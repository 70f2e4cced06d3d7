"""inspect and verify on a plain torch DCP directory (issue 35, item 4).

The directories are written by torch's own ``FileSystemWriter``: one by 2 gloo ranks with a
sharded tensor (world size 2), one in-process. ``inspect`` lists keys, dtypes, shapes, sizes and
the world size; ``verify`` checks every file is present with the byte ranges ``.metadata``
claims, hashes nothing (DCP records no checksums) and says so.
"""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.dist import run_ranks

from goodput_ckpt.cli import main
from goodput_ckpt.errors import CheckpointError
from goodput_ckpt.tools.ops._dcp_foreign import DCP_FORMAT, NO_HASHES
from goodput_ckpt.tools.ops.inspect import inspect_checkpoint
from goodput_ckpt.tools.ops.verify import verify_checkpoint

W = torch.arange(24.0).reshape(6, 4)


def _save_two_ranks(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {
        "model.w": distribute_tensor(W, mesh, [Shard(0)], src_data_rank=None),
        "model.b": torch.ones(3, dtype=torch.bfloat16),
        "step": 5,
    }
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp2") / "step_00000005"
    run_ranks(_save_two_ranks, 2, str(path), report_dir=path.parent / "reports", timeout=300)
    return path


@pytest.fixture
def one_rank(tmp_path):
    path = tmp_path / "dcp1"
    dcp.save({"model.w": W.clone(), "opt": {"lr": 0.1}}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return path


def test_inspect_lists_keys_shapes_dtypes_sizes_and_world_size(two_ranks):
    r = inspect_checkpoint(str(two_ranks))
    assert r.format == DCP_FORMAT and r.world_size == 2 and r.step == 5 and r.problems == []
    rows = {i.key: i for i in r.items}
    assert (rows["model.w"].dtype, rows["model.w"].shape, rows["model.w"].shards, rows["model.w"].bytes) == (
        "float32",
        [6, 4],
        2,
        96,
    )
    assert (rows["model.b"].dtype, rows["model.b"].shape, rows["model.b"].bytes) == ("bfloat16", [3], 6)
    assert rows["step"].kind == "object" and r.tensors == 2 and r.objects == 1 and r.tensor_bytes == 102
    assert r.files == 2 and r.file_bytes == sum(f.stat().st_size for f in two_ranks.glob("*.distcp"))


def test_inspect_on_the_command_line(two_ranks):
    out = io.StringIO()
    assert main(["inspect", str(two_ranks)], stdout=out, stderr=io.StringIO()) == 0
    text = out.getvalue()
    assert (
        "torch-dcp (torch DCP's FileSystemWriter layout" in text and "world size  2" in text and "(no hashes)" in text
    )
    assert "model.w" in text and "6x4" in text


def test_verify_checks_presence_and_sizes_and_says_it_hashed_nothing(two_ranks):
    r = verify_checkpoint(str(two_ranks))
    assert r.ok and r.format == DCP_FORMAT and r.world_size == 2 and r.files == 2 and r.bytes_hashed == 0
    assert r.notes == [NO_HASHES]
    out = io.StringIO()
    assert main(["verify", str(two_ranks), "--json"], stdout=out, stderr=io.StringIO()) == 0
    doc = json.loads(out.getvalue())
    assert doc["ok"] and doc["format"] == DCP_FORMAT and doc["notes"] == [NO_HASHES]


def test_verify_names_a_missing_and_a_short_file(two_ranks, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(two_ranks, bad)
    (bad / "__1_0.distcp").unlink()
    with open(bad / "__0_0.distcp", "r+b") as f:
        f.truncate(10)
    r = verify_checkpoint(str(bad))
    assert r.status == "corrupt"
    kinds = {p.kind: p for p in r.problems}
    assert set(kinds) == {"missing", "size"}
    assert kinds["missing"].file == "__1_0.distcp" and "model.w" in kinds["missing"].keys
    assert "is 10 bytes but .metadata places bytes up to" in kinds["size"].message
    err = io.StringIO()
    out = io.StringIO()
    assert main(["verify", str(bad)], stdout=out, stderr=err) == 1
    assert "CORRUPT" in out.getvalue() and "[missing]" in out.getvalue()
    assert inspect_checkpoint(str(bad)).problems  # inspect warns too


def test_one_rank_save_and_objects(one_rank):
    r = inspect_checkpoint(str(one_rank), pattern="opt.*")
    assert r.world_size == 1 and [i.key for i in r.items] == ["opt.lr"] and r.objects == 1
    assert verify_checkpoint(str(one_rank)).ok


def test_a_metadata_that_needs_pickle_is_refused_by_name(tmp_path, one_rank):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("boom",))

    (one_rank / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="restricted unpickler"):
        inspect_checkpoint(str(one_rank))


def test_a_file_name_that_leaves_the_directory_is_a_problem_not_a_crash(tmp_path, one_rank):
    """``.metadata`` is untrusted: its relative paths go through the store's name check."""
    import pickle

    from goodput_ckpt.tools._formats.dcp_metadata import load_metadata

    md = load_metadata((one_rank / ".metadata").read_bytes(), "x", trust_pickle=False)
    for info in md.storage_data.values():
        info.relative_path = "../outside.distcp"
    (one_rank / ".metadata").write_bytes(pickle.dumps(md))
    r = verify_checkpoint(str(one_rank))
    assert r.status == "corrupt" and [p.kind for p in r.problems] == ["unreadable"]
