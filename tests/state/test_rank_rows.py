"""Per-rank state as one row per rank (training-state schema 2): the RNG's packing, the row's DCP
protocol, the dataloader rows widened to the longest, the checks on what a manifest says about
them, 3 real ranks with states of different lengths, and a schema-1 checkpoint that still restores.

The rows of several real ranks (2 gloo processes, per-rank seeds, bit-exact after a kill) are
covered by tests/manager/test_resume.py; the cost it removes is measured in
benchmarks/bench_scale.py (``--state training`` against ``training-v1``), not timed here.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from goodput_ckpt import CheckpointManager
from goodput_ckpt.dcp.rank_rows import (
    RankRow,
    check_rank_rows,
    find_rank_rows,
    put_back_rank_rows,
    resolve_rank_row,
    row_widths,
    widen_rank_rows,
)
from goodput_ckpt.errors import CheckpointError, CorruptCheckpointError
from goodput_ckpt.format.manifest import Manifest
from goodput_ckpt.format.schema import TensorEntry
from goodput_ckpt.state import META_KEY, Topology, apply_restore, normalize, plan_restore
from goodput_ckpt.state.dataloader import decode_dataloader_row, encode_dataloader_row
from goodput_ckpt.state.rng import (
    MAX_LAYOUT_SLOTS,
    capture_rng,
    check_layout,
    check_rng,
    pack_rng,
    restore_rng,
    rng_layout,
    row_width,
    unpack_rng,
)

FIXTURE = Path(__file__).parent / "fixtures" / "schema1"


def _draws() -> tuple[list[float], list[float], list[float]]:
    return [random.random() for _ in range(3)], np.random.rand(3).tolist(), torch.rand(3).tolist()


def test_a_packed_row_restores_every_generator():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # a cached Gaussian in Python's state
    np.random.standard_normal()  # ... and NumPy's
    layout = rng_layout()
    row = pack_rng(capture_rng(), layout)
    assert row.shape == (1, row_width(layout)) and row.dtype == torch.uint8
    want = _draws()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    back = unpack_rng(row, layout)
    assert set(back) == {name for name, _, _ in layout}
    assert restore_rng(back) == []
    assert _draws() == want


def test_an_absent_generator_is_marked_not_zeroed():
    layout = rng_layout()
    state = capture_rng()
    del state["numpy"], state["numpy_pos"], state["numpy_gauss"]
    row = pack_rng(state, layout)
    assert sorted(unpack_rng(row, layout)) == sorted(state)
    assert torch.equal(unpack_rng(row, layout)["torch"], state["torch"])


def test_pack_refuses_what_does_not_fit_its_slot():
    layout = rng_layout()
    with pytest.raises(CheckpointError, match="no slot.*save_rng=False"):
        pack_rng({**capture_rng(), "cuda7": torch.zeros(16, dtype=torch.uint8)}, layout)
    with pytest.raises(CheckpointError, match="its slot"):
        pack_rng({**capture_rng(), "torch": torch.zeros(7, dtype=torch.uint8)}, layout)


def test_unpack_refuses_a_row_of_another_width_or_bad_flags():
    layout = rng_layout()
    row = pack_rng(capture_rng(), layout)
    with pytest.raises(ValueError, match="layout needs"):
        unpack_rng(row[:, :-1], layout)
    row[0, 0] = 2
    with pytest.raises(ValueError, match="presence"):
        unpack_rng(row, layout)


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        "python",
        [["python", "int64"]],
        [["python", "complex128", 3]],
        [["python", "int64", True]],
        [["python", "int64", -1]],
        [["python", "int64", 1 << 40]],  # bounded before it sizes a row
        [["", "int64", 1]],
        [["a", "uint8", 1], ["a", "uint8", 1]],
        [["s", "uint8", 1]] * (MAX_LAYOUT_SLOTS + 1),
        [["cudaX", "uint8", 16], ["torch", "uint8", 5056]],  # no such generator
        [["cuda0", "uint8", 8]],  # a CUDA state is 16 bytes
        [["python", "int64", 625]],  # without python_gauss it cannot be set
        [["python", "uint8", 5000], ["python_gauss", "float64", 2]],
        [["numpy", "int64", 624], ["numpy_pos", "int64", 2]],
        [["torch", "int64", 632]],
    ],
)
def test_a_layout_from_a_manifest_is_validated_and_bounded(bad):
    with pytest.raises(ValueError):
        check_layout(bad)


def test_check_layout_accepts_what_rng_layout_records():
    layout = rng_layout()
    assert check_layout([list(s) for s in layout]) == layout


def test_rank_row_speaks_dcps_checkpointable_protocol():
    row = RankRow(torch.arange(6, dtype=torch.uint8).reshape(1, 6), rank=2, world_size=5)
    assert row.size() == (5, 6)
    (item,) = row.__create_write_items__("rng.rows", row)
    assert item.type == WriteItemType.SHARD and item.tensor_data.size == (5, 6)
    assert tuple(item.tensor_data.chunk.offsets) == (2, 0) and tuple(item.tensor_data.chunk.sizes) == (1, 6)
    (chunk,) = row.__create_chunk_list__()
    assert tuple(chunk.offsets) == (2, 0)
    assert row.__get_tensor_shard__(MetadataIndex("rng.rows", torch.Size((2, 0)))) is row.row
    with pytest.raises(ValueError, match="not"):
        row.__get_tensor_shard__(MetadataIndex("rng.rows", torch.Size((1, 0))))
    with pytest.raises(ValueError):
        RankRow(torch.zeros(2, 6), rank=0, world_size=2)
    with pytest.raises(ValueError):
        RankRow(torch.zeros(1, 6), rank=2, world_size=2)


def test_rows_survive_the_load_planners_set_up():
    """torch's load set-up turns unknown values into None; the planner puts the rows back."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from goodput_ckpt.dcp.load_planner import GridLoadPlanner

    def dest():
        return {"model": {"w": torch.zeros(2)}, "rng": {"rows": RankRow(torch.zeros(1, 3), 0, 1)}}

    plain = dest()
    DefaultLoadPlanner().set_up_planner(plain, None)
    assert plain["rng"]["rows"] is None, "torch's behaviour this works around"
    d = dest()
    row = d["rng"]["rows"]
    planner = GridLoadPlanner()
    planner.set_up_planner(d, None)
    assert d["rng"]["rows"] is row and planner.state_dict["rng.rows"] is row
    nested = dest()
    found = find_rank_rows(nested)
    nested["rng"]["rows"] = None
    flat: dict = {}
    put_back_rank_rows(found, nested, flat, None)
    assert isinstance(nested["rng"]["rows"], RankRow) and flat == {}


def test_ranks_that_disagree_on_the_row_shape_fail_the_save_by_name():
    def plan(rank, width):
        r = RankRow(torch.zeros(1, width, dtype=torch.uint8), rank, 2)
        return SavePlan(r.__create_write_items__("rng.rows", r))

    check_rank_rows([plan(0, 8), plan(1, 8)])
    with pytest.raises(CheckpointError, match="rng.rows.*rank 0 saves \\(2, 8\\), rank 1 saves \\(2, 9\\)"):
        check_rank_rows([plan(0, 8), plan(1, 9)])


def _v2_manifest(rows: TensorEntry | None, layout=None) -> Manifest:
    layout = [list(s) for s in rng_layout()] if layout is None else layout
    meta = {
        "schema": 2,
        "step": 1,
        "world_size": 2,
        "sections": ["model", "rng"],
        "rng": {"base_seed": 0, "layout": layout},
        "dataloader": None,
        "stateful": [],
        "tied": {},
    }
    items = {"rng.rows": rows} if rows is not None else {}
    return Manifest(
        version=1,
        library_version="0",
        torch_version="0",
        created_at="",
        world_size=2,
        chunk_size=1 << 20,
        files={},
        items=items,
        metadata={META_KEY: meta},
    )


def _plan(manifest: Manifest):
    return plan_restore(
        manifest,
        where="loc",
        models=normalize(nn.Linear(2, 2), None),
        dataloader=None,
        stateful={},
        topology=Topology(1, 2),
        allow_topology_change=False,
    )


def test_restore_checks_the_rows_entry_against_layout_and_world_size():
    width = row_width(rng_layout())
    good = TensorEntry(key="rng.rows", dtype="uint8", shape=(2, width), chunks=())
    plan = _plan(_v2_manifest(good))
    row = plan.dest["rng"]["rows"]
    assert isinstance(row, RankRow) and (row.rank, row.world_size, tuple(row.row.shape)) == (1, 2, (1, width))
    row.row.fill_(7)  # what DCP would read from a damaged (or forged, re-hashed) file
    with pytest.raises(CorruptCheckpointError, match=r"rng\.rows\[1\]: .*presence"):
        apply_restore(plan)
    for bad in (
        None,
        TensorEntry(key="rng.rows", dtype="uint8", shape=(3, width), chunks=()),
        TensorEntry(key="rng.rows", dtype="uint8", shape=(2, width + 1), chunks=()),
        TensorEntry(key="rng.rows", dtype="int64", shape=(2, width), chunks=()),
    ):
        with pytest.raises(CorruptCheckpointError, match="rng.rows"):
            _plan(_v2_manifest(bad))
    with pytest.raises(CorruptCheckpointError, match="layout"):
        _plan(_v2_manifest(good, layout=[["python", "int64", "625"]]))


@pytest.mark.parametrize("batch", [3, 2])
def test_a_schema_1_checkpoint_still_restores(tmp_path, batch):
    """Written by the last package that wrote schema 1 (fixtures/make_schema1.py says how): the
    model, the optimizer, the generators and the loader position, as saved (batch 3) and
    elastically (batch 2: every old rank's loader state to the sampler)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from goodput_ckpt.data import ElasticSampler

    root = tmp_path / "run"
    shutil.copytree(FIXTURE, root)
    expected = json.loads((root / "expected.json").read_text())
    manifest = json.loads(next(root.glob("step_*/manifest.json")).read_text())
    assert manifest["metadata"]["training_state"]["schema"] == 1
    assert "rng.rank0.torch" in manifest["items"] and "dataloader.rank0" in manifest["items"]
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ids = list(range(24))
    loader = StatefulDataLoader(ids, batch_size=batch, sampler=ElasticSampler(ids, seed=5, num_replicas=1, rank=0))
    mgr = CheckpointManager(str(root), async_save=False)
    try:
        assert mgr.restore(model=model, optimizer=opt, dataloader=loader) == 3
    finally:
        mgr.close()
    assert model.weight.tolist() == expected["weight"] and model.bias.tolist() == expected["bias"]
    assert opt.state[model.weight]["exp_avg"].tolist() == expected["exp_avg_weight"]
    assert _draws() == (expected["python"], expected["numpy"], expected["torch"])
    rest = [i for b in loader for i in b.tolist()]
    if batch == 3:
        assert rest == expected["rest"], "the position as saved"
    else:
        assert sorted(expected["seen"] + rest) == ids, "elastic: every sample once"


# -- rows that differ in length: the dataloader states -----------------------------------------
def _row_plan(rank: int, world: int, width: int, *, widen: bool = True) -> SavePlan:
    r = RankRow(torch.full((1, width), rank, dtype=torch.uint8), rank, world, widen=widen)
    return SavePlan(r.__create_write_items__("dataloader.rows", r))


def test_the_global_plan_widens_rows_to_the_longest():
    keys = {"dataloader.rows"}
    plans = [_row_plan(0, 3, 5), _row_plan(1, 3, 9), _row_plan(2, 3, 7)]
    wide = widen_rank_rows(plans, keys)
    for rank, plan in enumerate(wide):
        (item,) = plan.items
        assert tuple(item.tensor_data.size) == (3, 9) and tuple(item.tensor_data.chunk.sizes) == (1, 9)
        assert tuple(item.tensor_data.chunk.offsets) == (rank, 0)
    check_rank_rows(wide)  # they tile now
    assert widen_rank_rows(plans, set()) == plans, "only the keys the planner is told of"
    row = RankRow(torch.full((1, 5), 4, dtype=torch.uint8), 0, 3, widen=True)
    state = {"dataloader.rows": row}
    assert row_widths(wide[0], keys) == {"dataloader.rows": (9, torch.uint8)}
    padded = resolve_rank_row(state, wide[0].items[0].index, row_widths(wide[0], keys))
    assert padded.tolist() == [[4] * 5 + [0] * 4]


def test_a_rank_without_the_row_writes_zeros():
    """A rank whose save got no dataloader: the coordinator adds its row, the rank writes zeros
    (a length of 0, which the restore reads as "nothing saved")."""
    keys = {"dataloader.rows"}
    plans = [_row_plan(0, 3, 10), SavePlan([]), _row_plan(2, 3, 12)]
    wide = widen_rank_rows(plans, keys)
    (item,) = wide[1].items
    assert tuple(item.tensor_data.chunk.offsets) == (1, 0) and tuple(item.tensor_data.size) == (3, 12)
    check_rank_rows(wide)
    zeros = resolve_rank_row({}, item.index, row_widths(wide[1], keys))
    assert zeros.shape == (1, 12) and not zeros.any()
    with pytest.raises(CheckpointError, match="no dataloader state was saved"):
        decode_dataloader_row(zeros, key="dataloader.rows[1]")
    with pytest.raises(ValueError, match="cannot be written"):
        RankRow(torch.zeros(1, 5), 0, 1).padded(9)  # a fixed-width row is never widened
    with pytest.raises(ValueError):
        RankRow(torch.zeros(1, 2, 2), 0, 1, widen=True)


def test_a_dataloader_row_bounds_its_length():
    class Loader:
        def state_dict(self):
            return {"pos": torch.arange(4)}

    row = encode_dataloader_row(Loader(), key="k")
    assert int.from_bytes(row[0, :8].numpy().tobytes(), "little") == row.shape[1] - 8
    wide = torch.cat([row, torch.zeros((1, 11), dtype=torch.uint8)], dim=1)
    assert torch.equal(decode_dataloader_row(wide, key="k")["pos"], torch.arange(4))
    bad = wide.clone()
    bad[0, :8] = torch.tensor(list((wide.shape[1]).to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="claims"):
        decode_dataloader_row(bad, key="k")
    with pytest.raises(CheckpointError, match="at least 8"):
        decode_dataloader_row(torch.zeros((1, 3), dtype=torch.uint8), key="k")


def test_restore_checks_the_dataloader_rows_entry():
    width = row_width(rng_layout())
    good = TensorEntry(key="rng.rows", dtype="uint8", shape=(2, width), chunks=())
    m = _v2_manifest(good)
    m.metadata[META_KEY]["dataloader"] = {"num_workers": 0, "batch_size": 1, "elastic": False}
    m.metadata[META_KEY]["sections"].append("dataloader")
    for bad in (
        None,
        TensorEntry(key="dataloader.rows", dtype="uint8", shape=(3, 20), chunks=()),
        TensorEntry(key="dataloader.rows", dtype="uint8", shape=(2,), chunks=()),
        TensorEntry(key="dataloader.rows", dtype="float32", shape=(2, 20), chunks=()),
    ):
        items = {"rng.rows": good} | ({} if bad is None else {"dataloader.rows": bad})
        with pytest.raises(CorruptCheckpointError, match="dataloader.rows"):
            plan_restore(
                dataclasses.replace(m, items=items),
                where="loc",
                models=normalize(nn.Linear(2, 2), None),
                dataloader=_UnequalLoader(1),
                stateful={},
                topology=Topology(1, 2),
                allow_topology_change=False,
            )


def test_a_bad_saved_generator_fails_before_anything_is_loaded():
    width = row_width(rng_layout())
    good = TensorEntry(key="rng.rows", dtype="uint8", shape=(2, width), chunks=())
    model = nn.Linear(2, 2)
    before = model.weight.detach().clone()
    plan = _plan(_v2_manifest(good))
    plan.dest["model"]["weight"].fill_(1.0)
    plan.dest["rng"]["rows"].row.zero_()
    plan.dest["rng"]["rows"].row[0, : len(rng_layout())] = 1  # every slot present, every state zeros
    plan.models = normalize(model, None)
    with pytest.raises(CorruptCheckpointError, match=r"rng.rows\[1\]"):
        apply_restore(plan)
    assert torch.equal(model.weight, before), "nothing loaded"


class _UnequalLoader:
    """A dataloader whose state's length depends on the rank: the rows differ in width."""

    num_workers, batch_size = 0, 1

    def __init__(self, rank: int) -> None:
        self.state = {"rank": rank, "seen": list(range(rank * 40))}

    def state_dict(self):
        return self.state

    def load_state_dict(self, sd):
        self.state = sd


def _save_and_restore_unequal(rank: int, world: int, root: str) -> None:
    # Rank 2 saves no dataloader (as a pipeline stage without data would): its row is zeros.
    loader, model = (_UnequalLoader(rank) if rank < 2 else None), nn.Linear(2, 2)  # init draws from torch's RNG
    random.seed(100 + rank)
    torch.manual_seed(200 + rank)
    want = (random.random(), torch.rand(2).tolist())
    random.seed(100 + rank)
    torch.manual_seed(200 + rank)
    with CheckpointManager(root, async_save=True) as mgr:  # the staged copy goes through the stager too
        mgr.save(1, model=model, dataloader=loader)
        mgr.wait()
        # Every rank restores with a loader: rank 2's row is zeros. It finds that in the read
        # phase of the rows' load, and the restore fails on every rank, by name, before any
        # rank's model, generators or loader change (the model's tensors are read after the rows).
        target, loader = nn.Linear(2, 2), _UnequalLoader(0)  # init draws from torch's RNG
        weights = [p.detach().clone() for p in target.parameters()]
        generators = torch.get_rng_state()
        with pytest.raises(CheckpointError, match=r"no dataloader state was saved in 'dataloader\.rows\[2\]'"):
            mgr.restore(model=target, dataloader=loader)
        assert loader.state == {"rank": 0, "seen": []} and torch.equal(torch.get_rng_state(), generators)
        assert all(torch.equal(p, w) for p, w in zip(target.parameters(), weights)), "the model is unchanged"
        fresh = _UnequalLoader(0) if rank < 2 else None
        random.seed(0)
        torch.manual_seed(0)
        assert mgr.restore(model=nn.Linear(2, 2), dataloader=fresh) == 1
    if rank < 2:
        assert fresh.state == {"rank": rank, "seen": list(range(rank * 40))}, "its own state, unpadded"
    assert (random.random(), torch.rand(2).tolist()) == want, "its own generators"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_ranks_with_loader_states_of_different_lengths_restore_their_own(tmp_path):
    from helpers.dist import run_ranks

    run_ranks(_save_and_restore_unequal, 3, str(tmp_path / "run"), report_dir=tmp_path / "report", timeout=240)
    manifest = json.loads(next((tmp_path / "run").glob("step_*/manifest.json")).read_text())
    items = manifest["items"]
    assert not any(k.startswith(("rng.rank", "dataloader.rank")) for k in items), "no item per rank"
    rows = items["dataloader.rows"]
    longest = encode_dataloader_row(_UnequalLoader(1), key="k").shape[1]  # rank 1's state is the longest
    assert rows["shape"] == [3, longest] and rows["grid"]["block"] == [1, longest], "one grid: a row per rank"
    assert items["rng.rows"]["grid"]["block"][0] == 1 and items["rng.rows"]["shape"][0] == 3


@pytest.mark.parametrize(
    ("slot", "index", "value"),
    [
        ("numpy_pos", 0, 10**6),  # NumPy takes it, and its next draw reads outside its buffer
        ("numpy_pos", 0, -5),
        ("numpy_pos", 1, 2),
        ("numpy", 3, -1),
        ("numpy", 3, 1 << 32),  # cut to 32 bits without a word
        ("python", 0, -1),  # random.setstate raises OverflowError, not ValueError
        ("python", 0, 1 << 32),
        ("python", 624, 625),
        ("python_gauss", 0, 0.5),
    ],
)
def test_generator_values_a_capture_never_makes_are_refused(slot, index, value):
    check_rng(capture_rng())
    state = {name: t.clone() for name, t in capture_rng().items()}
    state[slot][index] = value
    with pytest.raises(ValueError, match=slot):
        check_rng(state)
    layout = rng_layout()
    plan = _plan(_v2_manifest(TensorEntry(key="rng.rows", dtype="uint8", shape=(2, row_width(layout)), chunks=())))
    plan.dest["rng"]["rows"].row.copy_(pack_rng(state, layout))
    with pytest.raises(CorruptCheckpointError, match=r"rng\.rows\[1\]"):
        apply_restore(plan)


def test_rows_that_rank_0_lacks_fail_the_save_by_name():
    """The coordinator's metadata describes the rows (a loader's workers, batch size): rows
    that only other ranks hold would be written and never read."""
    with pytest.raises(CheckpointError, match="rank 0 .*rank 1 does"):
        widen_rank_rows([SavePlan([]), _row_plan(1, 3, 9), _row_plan(2, 3, 7)], {"dataloader.rows"})


def test_loader_states_read_counts_rows_and_schema_1_keys_from_the_readers_counters():
    """The restore record's ``loader_states`` (state.per_rank.loader_states_read): the rows of
    ``dataloader.rows`` and schema 1's ``dataloader.rank{r}`` keys, over every reader, and
    nothing else (a model key, the RNG rows)."""
    from goodput_ckpt.state.per_rank import loader_states_read

    rows = [{"dataloader.rows": 3, "rng.rows": 4}, {"dataloader.rows": 1}]
    keys = [{"dataloader.rank0": 1, "dataloader.rank1": 1, "model.w": 1, "dataloader.rows": 9}, {}]
    assert loader_states_read(rows, keys) == 3 + 1 + 2
    assert loader_states_read([], []) == 0
