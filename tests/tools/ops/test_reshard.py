"""reshard_checkpoint: dim-0 layout, per-rank policy, damaged inputs, and real multi-rank loads.

The multi-rank test runs one 3-rank gloo group for every check (a group costs 10-30 s here):
DTensor ``Shard(0)`` loads of checkpoints resharded to 3, 2 and 1 ranks, an FSDP2 model resumed
from a resharded checkpoint, and a 3-rank save (``Shard(0)`` and ``Shard(1)`` tensors) that the
parent then reshards to 2 and 1 ranks and checks in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.dist import run_ranks
from helpers.samples import flat_tensors, flip_byte, item_range, manifest, sample_state, save
from helpers.trees import assert_tree_equal, zeros_like

from goodput_ckpt import (
    CheckpointExistsError,
    CheckpointReader,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from goodput_ckpt.dcp.read_sources import ReadSources
from goodput_ckpt.format import MANIFEST_NAME
from goodput_ckpt.format.manifest import parse_manifest
from goodput_ckpt.storage import open_store
from goodput_ckpt.tools.ops.reshard import per_rank_keys, reshard_checkpoint
from goodput_ckpt.tools.ops.verify import verify_checkpoint


def _load_plain(path, like):
    dest = zeros_like(like)
    dcp.load(dest, storage_reader=CheckpointReader(str(path)))
    return dest


def _split_keys(path) -> dict[str, list[dict]]:
    m = manifest(path)
    return {k: v["chunks"] for k, v in m["items"].items() if v["kind"] == "tensor"}


def test_reshard_to_three_ranks_lays_out_dim0_regions(sample_ckpt, tmp_path):
    src, sd = sample_ckpt
    dst = tmp_path / "w3"
    r = reshard_checkpoint(str(src), str(dst), world_size=3, rank_state="keep")
    assert (r.src_world_size, r.world_size, r.rank_state) == (1, 3, "keep")
    assert r.per_rank_kept == ["rng.rank0.cpu", "dataloader.rank0"] and not r.per_rank_dropped
    assert r.tensor_bytes == sum(t.numel() * t.element_size() for t in flat_tensors(sd).values())
    m = manifest(dst)
    assert m["world_size"] == 3 and len(m["files"]) == 3
    files = sorted(m["files"])
    assert all(f.startswith(f"rank{i:05d}-00.") for i, f in enumerate(files))
    tensors = flat_tensors(sd)
    for key, chunks in _split_keys(dst).items():
        t = tensors[key]
        if key.startswith(("rng.", "dataloader.")) or t.dim() == 0 or t.numel() == 0:
            assert len(chunks) == 1 and chunks[0]["file"] == files[0], key
            continue
        want = torch.chunk(torch.arange(t.shape[0]), 3)  # FSDP2's Shard(0) split
        assert len(chunks) == len(want), key
        for rank, (c, rows) in enumerate(zip(chunks, want)):
            assert c["file"] == files[rank], key
            assert c["offsets"][0] == rows[0].item() and c["sizes"][0] == len(rows), key
            assert c["offsets"][1:] == [0] * (t.dim() - 1) and c["sizes"][1:] == list(t.shape[1:])
    assert verify_checkpoint(str(dst)).ok
    assert m["metadata"]["goodput_reshard"] == {
        "from_world_size": 1,
        "world_size": 3,
        "rank_state": "keep",
        "dropped": 0,
    }
    assert m["metadata"]["step"] == 100
    assert_tree_equal(_load_plain(dst, sd), sd)


def test_world_size_one_consolidates(sample_ckpt, tmp_path):
    src, sd = sample_ckpt
    mid, out = tmp_path / "w2", tmp_path / "w1"
    reshard_checkpoint(str(src), str(mid), world_size=2, rank_state="keep")
    r = reshard_checkpoint(str(mid), str(out), world_size=1, rank_state="keep")
    assert r.rank_state == "keep" and r.src_world_size == 2
    m = manifest(out)
    assert m["world_size"] == 1 and len(m["files"]) == 1
    assert all(len(chunks) == 1 for chunks in _split_keys(out).values())
    assert_tree_equal(_load_plain(out, sd), sd)


def test_per_rank_policy(sample_ckpt, tmp_path):
    src, sd = sample_ckpt
    assert per_rank_keys(
        ["rng.rank0.cpu", "dataloader.rank12", "dataloader.rank_3", "model.rank1.w", "rng.seed", "rng.rows"]
    ) == {"rng.rank0.cpu": 0, "dataloader.rank12": 12, "dataloader.rank_3": 3, "rng.rows": 0}
    with pytest.raises(ValueError, match="rank-state"):
        reshard_checkpoint(str(src), str(tmp_path / "a"), world_size=2)
    assert not (tmp_path / "a" / MANIFEST_NAME).exists()
    r = reshard_checkpoint(str(src), str(tmp_path / "b"), world_size=2, rank_state="drop")
    assert sorted(r.per_rank_dropped) == ["dataloader.rank0", "rng.rank0.cpu"]
    items = manifest(tmp_path / "b")["items"]
    assert not any(k.startswith(("rng.", "dataloader.")) for k in items)
    r = reshard_checkpoint(str(src), str(tmp_path / "c"), world_size=1)  # unchanged world size: keep
    assert r.rank_state == "keep" and "rng.rank0.cpu" in manifest(tmp_path / "c")["items"]
    with pytest.raises(ValueError):
        reshard_checkpoint(str(src), str(tmp_path / "d"), world_size=2, rank_state="bogus")


def test_drop_updates_the_managers_training_state(tmp_path):
    from goodput_ckpt import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 7)
    mgr = CheckpointManager(str(tmp_path / "run"), async_save=False)
    try:
        saved_rng = torch.get_rng_state()
        mgr.save(5, model=model)
    finally:
        mgr.close()
    src = tmp_path / "run" / "step_00000005"
    dst = tmp_path / "run2" / "step_00000005"
    reshard_checkpoint(str(src), str(dst), world_size=4, rank_state="drop")
    ts = manifest(dst)["metadata"]["training_state"]
    assert ts["world_size"] == 4 and ts["rng"] is None and "rng" not in ts["sections"]
    assert "rng.rows" in manifest(src)["items"] and not any(k.startswith("rng.") for k in manifest(dst)["items"])
    with pytest.raises(ValueError, match="rank-state"):  # all ranks' RNG rows: not split silently
        reshard_checkpoint(str(src), str(tmp_path / "auto4"), world_size=4)
    kept = reshard_checkpoint(str(src), str(tmp_path / "run3" / "step_00000005"), world_size=1)
    assert kept.rank_state == "keep" and kept.per_rank_kept == ["rng.rows"]
    torch.manual_seed(123)
    mgr = CheckpointManager(str(tmp_path / "run3"), async_save=False)
    try:
        assert mgr.restore(model=torch.nn.Linear(5, 7)) == 5
    finally:
        mgr.close()
    assert torch.equal(torch.get_rng_state(), saved_rng), "the kept rows restore the generators"
    restored = torch.nn.Linear(5, 7)
    mgr = CheckpointManager(str(tmp_path / "run2"), async_save=False)
    try:
        # No per-rank state is left, so one process restores what 4 ranks would read.
        assert mgr.restore(model=restored) == 5
    finally:
        mgr.close()
    assert torch.equal(restored.weight, model.weight) and torch.equal(restored.bias, model.bias)


def test_damaged_and_incomplete_sources_commit_nothing(ckpt, tmp_path):
    f, off, n = item_range(ckpt, "model.embed.weight")
    flip_byte(ckpt, f, off + n // 3)
    with pytest.raises(CorruptCheckpointError, match="model.embed.weight") as info:
        reshard_checkpoint(str(ckpt), str(tmp_path / "out"), world_size=2, rank_state="drop")
    assert info.value.byte_range is not None and f in info.value.path
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
    (ckpt / MANIFEST_NAME).unlink()
    with pytest.raises(IncompleteCheckpointError):
        reshard_checkpoint(str(ckpt), str(tmp_path / "out"), world_size=2, rank_state="drop")


def test_truncated_source(ckpt, tmp_path):
    f, _, _ = item_range(ckpt, "model.embed.weight")
    with open(ckpt / f, "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        reshard_checkpoint(str(ckpt), str(tmp_path / "out"), world_size=2, rank_state="drop")


def test_existing_destination_and_same_location(sample_ckpt, tmp_path):
    src, sd = sample_ckpt
    dst = tmp_path / "out"
    reshard_checkpoint(str(src), str(dst), world_size=2, rank_state="keep")
    with pytest.raises(CheckpointExistsError):
        reshard_checkpoint(str(src), str(dst), world_size=3, rank_state="keep")
    old_files = set(manifest(dst)["files"])
    reshard_checkpoint(str(src), str(dst), world_size=3, rank_state="keep", overwrite=True)
    new = manifest(dst)
    assert new["world_size"] == 3 and not old_files & set(new["files"])
    assert sorted(p.name for p in dst.iterdir()) == sorted(list(new["files"]) + [MANIFEST_NAME])
    with pytest.raises(ValueError, match="differ"):
        reshard_checkpoint(str(src), str(src) + "/", world_size=2, rank_state="keep")


def test_thread_and_chunk_settings_do_not_change_the_result(sample_ckpt, tmp_path):
    src, sd = sample_ckpt
    for i, (threads, chunk) in enumerate([(1, 4096), (8, 1 << 20)]):
        out = tmp_path / f"o{i}"
        reshard_checkpoint(str(src), str(out), world_size=3, rank_state="keep", thread_count=threads, chunk_size=chunk)
        assert manifest(out)["hash"]["chunk_size"] == chunk
        assert verify_checkpoint(str(out)).ok
        assert_tree_equal(_load_plain(out, sd), sd)


# -- multi-rank -----------------------------------------------------------------------------------


def _fsdp_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 11), torch.nn.ReLU(), torch.nn.Linear(11, 2))


class _RecordingOrigin:
    """A checkpoint's own store as a ``FileOrigin`` that records which data files are opened
    (handed to the reader through its public ``ReadSources.read_from``)."""

    def __init__(self, store, opened):
        self.uri, self._store, self._opened = store.uri, store, opened

    def open_source(self, name):
        self._opened.add(name)
        return self._store.open_source(name)


def _zero_shard(t: torch.Tensor, mesh, rank: int, world_size: int):
    """A zero DTensor placed Shard(0) like ``t`` (built locally: gloo cannot scatter fp8)."""
    from torch.distributed.tensor import DTensor, Shard

    pieces = torch.chunk(t, world_size)
    local = torch.zeros_like(pieces[rank]) if rank < len(pieces) else torch.zeros_like(t[:0])
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())


def _rank_checks(rank: int, world_size: int, paths: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    full = {k: v for k, v in flat_tensors(sample_state()).items() if k.startswith(("model.", "optimizer."))}

    # 1. DTensor Shard(0) loads of the checkpoints resharded to 3, 2 and 1 ranks.
    for name in ("w3", "w2", "w1"):
        dest = {}
        for k, t in full.items():
            dest[k] = _zero_shard(t, mesh, rank, world_size) if t.dim() else torch.zeros_like(t)
        opened: set[str] = set()
        files = sorted(json.loads(Path(paths[name], MANIFEST_NAME).read_text())["files"])
        origin = _RecordingOrigin(open_store(paths[name]), opened)
        reader = CheckpointReader(paths[name], sources=ReadSources(read_from=dict.fromkeys(files, origin)))
        dcp.load(dest, storage_reader=reader)
        for k, t in full.items():
            got = dest[k].to_local() if t.dim() else dest[k]
            if t.dim() == 0:
                want = t
            else:
                pieces = torch.chunk(t, world_size)
                want = pieces[rank] if rank < len(pieces) else t[:0]
            assert torch.equal(
                got.contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)
            ), (name, k, rank)
        if name == "w3":
            # Each rank reads its own file, plus rank 0's for 0-dim tensors and objects.
            assert opened <= {files[rank], files[0]}, (rank, opened)
            assert files[rank] in opened

    # 2. An FSDP2 model resumed from a checkpoint resharded for this world size.
    model = _fsdp_model(seed=123)
    fully_shard(model, mesh=mesh)
    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, storage_reader=CheckpointReader(paths["fsdp3"]))
    set_model_state_dict(model, msd)
    ref = _fsdp_model(seed=1)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.full_tensor(), q), n

    # 3. A 3-rank save with Shard(0) and Shard(1) tensors, resharded later by the parent.
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(10, 7, generator=g), torch.randn(5, 9, generator=g)
    state = {"a": distribute_tensor(a, mesh, [Shard(0)]), "b": distribute_tensor(b, mesh, [Shard(1)]), "n": 4}
    from goodput_ckpt import CheckpointWriter

    dcp.save(state, storage_writer=CheckpointWriter(paths["saved3"], chunk_size=4096))
    dist.barrier()


@pytest.mark.multiproc
@pytest.mark.slow
def test_resharded_checkpoints_load_at_m_ranks(sample_ckpt, tmp_path):
    src, sd = sample_ckpt
    paths = {name: str(tmp_path / name) for name in ("w3", "w2", "w1", "fsdp1", "fsdp3", "saved3")}
    reshard_checkpoint(str(src), paths["w3"], world_size=3, rank_state="drop")
    reshard_checkpoint(str(src), paths["w2"], world_size=2, rank_state="drop")
    reshard_checkpoint(str(src), paths["w1"], world_size=1)
    ref = _fsdp_model(seed=1)
    save(paths["fsdp1"], {"model": ref.state_dict()})
    reshard_checkpoint(paths["fsdp1"], paths["fsdp3"], world_size=3)
    run_ranks(_rank_checks, 3, paths, report_dir=tmp_path / "ranks", timeout=300)

    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(10, 7, generator=g), torch.randn(5, 9, generator=g)
    saved = parse_manifest(Path(paths["saved3"], MANIFEST_NAME).read_bytes())  # expands v2 grids
    assert saved.world_size == 3 and len(saved.items["b"].chunks) == 3
    for m in (2, 1):
        out = str(tmp_path / f"saved3-to-{m}")
        reshard_checkpoint(paths["saved3"], out, world_size=m)
        chunks = _split_keys(out)
        assert len(chunks["a"]) == m and len(chunks["b"]) == m  # Shard(1) source, dim-0 output
        assert [c["sizes"][0] for c in chunks["b"]] == [len(x) for x in torch.chunk(torch.arange(5), m)]
        got = _load_plain(out, {"a": a, "b": b, "n": 0})
        assert torch.equal(got["a"], a) and torch.equal(got["b"], b) and got["n"] == 4
