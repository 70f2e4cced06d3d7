"""ReplicaGroupingSavePlanner: small replicated values are saved once, by the lowest rank that
holds them; large replicated tensors keep torch's balancing; one rank's own values stay its own.
(The requests it saves at restore are counted in tests/storage/test_s3_requests.py.)
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

from goodput_ckpt.dcp.save_planner import SMALL_REPLICA_BYTES, ReplicaGroupingSavePlanner, group_small_replicas


def _plans(world: int) -> list:
    big = torch.zeros(SMALL_REPLICA_BYTES // 4 + 1)  # just over the limit
    plans = []
    for rank in range(world):
        sd = {f"opt.{i}.step": torch.tensor(float(i)) for i in range(20)}
        sd |= {"lr": 0.1, "big.a": big, "big.b": big.clone(), f"rng.rank{rank}": torch.tensor(rank)}
        plans.append(create_default_local_save_plan(sd, rank == 0))
    return plans


def _keys(plan) -> set[str]:
    return {it.index.fqn for it in plan.items}


def test_small_replicas_go_to_the_lowest_rank_and_the_rest_is_untouched() -> None:
    plans = _plans(4)
    grouped = group_small_replicas(plans)
    small = {f"opt.{i}.step" for i in range(20)} | {"lr"}
    assert small <= _keys(grouped[0])
    for rank in range(4):
        assert f"rng.rank{rank}" in _keys(grouped[rank])  # one rank's own value stays there
        assert {"big.a", "big.b"} <= _keys(grouped[rank])  # large replicas: torch's dedup decides
        if rank:
            assert not small & _keys(grouped[rank])


def test_the_global_plan_saves_every_value_once() -> None:
    planner = ReplicaGroupingSavePlanner(flatten_state_dict=False)  # the plans here are flat already
    plans, metadata = planner.create_global_plan(_plans(4))
    where = {}
    for rank, plan in enumerate(plans):
        for it in plan.items:
            assert it.index.fqn not in where, it.index.fqn
            where[it.index.fqn] = rank
    assert set(where) == set(metadata.state_dict_metadata)
    assert all(where[f"opt.{i}.step"] == 0 for i in range(20)) and where["lr"] == 0
    assert {where["big.a"], where["big.b"]} != {0}  # torch still spreads what is large
    assert [where[f"rng.rank{r}"] for r in range(4)] == [0, 1, 2, 3]


def _save_mixed(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from goodput_ckpt import CheckpointWriter

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(6):  # shards and small replicated values interleaved, as an optimizer state is
        sd[f"{i}.exp_avg"] = distribute_tensor(torch.randn(4096, generator=g), mesh, [Shard(0)], src_data_rank=None)
        sd[f"{i}.step"] = torch.tensor(float(i))
    sd["lr"] = 0.1
    dcp.save(sd, storage_writer=CheckpointWriter(path), planner=ReplicaGroupingSavePlanner())


def test_small_replicas_lie_together_in_one_chunk_of_the_lowest_ranks_file(tmp_path) -> None:
    """Together, in one hash chunk, after the rank's shards (engine/layout.py: the shards lie at
    one offset in every rank's file, issue 37)."""
    from helpers.dist import run_ranks

    from goodput_ckpt.format.manifest import MANIFEST_NAME, parse_manifest

    path = tmp_path / "ck"
    run_ranks(_save_mixed, 2, str(path), timeout=300, report_dir=tmp_path / "ranks")
    m = parse_manifest((path / MANIFEST_NAME).read_bytes())
    small, shards = [], []
    for key, e in m.items.items():
        if key.endswith(".exp_avg"):
            shards += [c for c in e.chunks if c.file.startswith("rank00000-")]
        else:
            small.append(e if e.kind == "object" else e.chunks[0])
    assert len(small) == 7 and all(c.file.startswith("rank00000-") for c in small)
    start, end = min(c.offset for c in small), max(c.offset + c.length for c in small)
    assert max(c.offset + c.length for c in shards) <= start and end - start < 64 << 10
    assert start // m.chunk_size == (end - 1) // m.chunk_size


def test_the_writer_refuses_torchs_plan_caching(tmp_path) -> None:
    """With enable_plan_caching a rank whose plan did not change gets the previous save's final
    plan, file names included: refused before anything is written, on the first save already."""
    import inspect

    import pytest
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from goodput_ckpt import CheckpointError, CheckpointWriter

    if "enable_plan_caching" not in inspect.signature(DefaultSavePlanner).parameters:
        pytest.skip("this torch has no save-plan caching")
    state = {"w": torch.arange(8.0)}
    dcp.save(state, storage_writer=CheckpointWriter(tmp_path / "ok"), no_dist=True)
    with pytest.raises(CheckpointException) as info:  # dcp.save wraps each rank's error
        dcp.save(
            state,
            storage_writer=CheckpointWriter(tmp_path / "cached"),
            planner=DefaultSavePlanner(enable_plan_caching=True),
            no_dist=True,
        )
    (failure,) = info.value.failures.values()
    err = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback) in torch 2.13
    assert isinstance(err, CheckpointError) and "enable_plan_caching" in str(err)
    assert not any((tmp_path / "cached").glob("*.bin"))  # nothing written


def test_empty_shards_are_dropped_before_dedup_and_empty_tensors_kept() -> None:
    """FSDP2's empty shards (ranks past a tensor's end) share one index, which torch's dedup would
    hand to one rank each: dropped; a tensor without elements keeps its shards."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from goodput_ckpt.dcp.save_planner import drop_empty_shards

    def shard(fqn, offset, rows, total):
        chunk = ChunkStorageMetadata(offsets=torch.Size((offset, 0)), sizes=torch.Size((rows, 4)))
        data = TensorWriteData(
            chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=torch.Size((total, 4))
        )
        return WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD, tensor_data=data)

    plans = [
        SavePlan([shard("a", min(r, 3), 1 if r < 3 else 0, 3), shard("z", 0, 0, 0)], planner_data={}) for r in range(5)
    ]
    out = drop_empty_shards(plans)
    assert [[it.index.fqn for it in p.items] for p in out] == [["a", "z"]] * 3 + [["z"]] * 2
    planner = ReplicaGroupingSavePlanner()
    planner.set_up_planner({}, None, True)
    _, md = planner.create_global_plan(plans)
    assert [tuple(c.sizes) for c in md.state_dict_metadata["a"].chunks] == [(1, 4)] * 3
    assert "z" in md.state_dict_metadata
