"""Multi-rank DCP round trips through CheckpointWriter/CheckpointReader, on real gloo processes.

One 2-rank group runs every save scenario (starting a group costs 10-30 s on 2 cores):

- ``fsdp``: FSDP2 (``fully_shard``) model and Adam state after two steps, through
  ``get_state_dict``;
- ``dtensor``: DTensors placed ``Shard(0)``, ``Shard(1)`` and ``Replicate()``, uneven splits, and
  a non-tensor value;
- ``async_thread`` / ``async_process``: ``dcp.async_save`` with both executors and no stager
  (the writer stages itself; the thread executor on a dedicated gloo group); the state is
  mutated in place right after the call returns and the checkpoint must hold the values from
  before;
- ``save_errors``: a save refused on the coordinator fails on every rank, with every executor;
- ``checkpoint_id``: one writer reused for three sequential saves through ``checkpoint_id=``.

Each scenario leaves a ``done-<name>`` marker, so a failure is reported against the scenario
that broke. The checkpoints are then loaded in 1 process into plain tensors (and into an
unsharded model and Adam) and in a 3-rank group with different placements, and compared with
``torch.equal`` to reference full tensors.

Tests that need the gloo ranks (or their checkpoints) are marked ``multiproc``. Unmarked
single-process tests (no process group): ``dcp.async_save`` with mutation right after the call,
and saves that fail between the writer's calls without locking the writer for the next one.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.dist import run_ranks
from torch import nn

from goodput_ckpt import CheckpointExistsError, CheckpointReader, CheckpointWriter
from goodput_ckpt.errors import find_checkpoint_error

SAVE_SCENARIOS = ("fsdp", "dtensor", "async_thread", "async_process", "save_errors", "checkpoint_id")
NOT_LOADED = "<not loaded>"


# -- state shared by the workers and the checks -----------------------------------------------
def _model(seed: int) -> nn.Module:
    # FSDP2 splits dim 0 unevenly: 11 rows -> 6/5 on 2 ranks and 4/4/3 on 3; the last layer's
    # 2 rows leave rank 2 of 3 with empty shards of its weight, bias and Adam state.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 11), nn.ReLU(), nn.Linear(11, 2))


def _fsdp(seed: int, mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(steps):
        model(torch.randn(4, 6, generator=g)).sum().backward()
        optim.step()
        optim.zero_grad()


def dtensor_reference() -> dict[str, torch.Tensor]:
    """Full tensors of the ``dtensor`` scenario (the same in every process)."""
    g = torch.Generator().manual_seed(1234)
    return {
        "f32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(5, 9, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (3, 4), generator=g),
        "f64": torch.randn(5, generator=g, dtype=torch.float64),
        "flag": torch.rand(7, 3, generator=g) > 0.5,
        "tiny": torch.randn(1, 4, generator=g),  # Shard(0) over 2+ ranks: empty local shards
        "big": torch.randn(301, 37, generator=g),  # spans many 4 KiB hash chunks
    }


def _shard(d: int):
    from torch.distributed.tensor import Shard

    return [Shard(d)]


def _replicate():
    from torch.distributed.tensor import Replicate

    return [Replicate()]


#: Save placements on 2 ranks, and two different ones for the 3-rank load.
SAVE_PLACEMENTS = {"f32": (0,), "bf16": (1,), "i64": (), "f64": (0,), "flag": (0,), "tiny": (0,), "big": (0,)}
LOAD_PLACEMENTS = [
    # 3-way, uneven, some ranks empty
    {"f32": (0,), "bf16": (1,), "i64": (0,), "f64": (0,), "flag": (1,), "tiny": (0,), "big": (1,)},
    # swapped or replicated
    {"f32": (1,), "bf16": (0,), "i64": (), "f64": (), "flag": (), "tiny": (1,), "big": ()},
]


def _placements(dims: tuple[int, ...]):
    return _shard(dims[0]) if dims else _replicate()


def _distribute(full: dict[str, torch.Tensor], mesh, placements: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank holds the full tensor, so no scatter is needed.
    return {k: distribute_tensor(v, mesh, _placements(placements[k]), src_data_rank=None) for k, v in full.items()}


def _full_state(model=None, optim=None, dts: dict[str, Any] | None = None, extra=None) -> dict[str, Any]:
    """A detached, cloned full-tensor copy of the given state (collective: all ranks call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    out: dict[str, Any] = {}
    if model is not None:
        msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
        out["model"], out["optim"] = msd, osd
    if dts is not None:
        out["dt"] = {k: v.full_tensor() for k, v in dts.items()}
    if extra is not None:
        out["extra"] = extra
    return _map_tensors(out, lambda t: t.detach().clone())


def _map_tensors(tree: Any, fn) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_tensors(v, fn) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_map_tensors(v, fn) for v in tree)
    return tree


def _tensors(tree: Any) -> list[tuple[str, torch.Tensor]]:
    out = []

    def walk(t, path):
        if isinstance(t, torch.Tensor):
            out.append((path, t))
        elif isinstance(t, dict):
            for k, v in t.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(t, (list, tuple)):
            for i, v in enumerate(t):
                walk(v, f"{path}.{i}")

    walk(tree, "")
    return out


def plain_target(ref: Any) -> Any:
    """Load destination shaped like ``ref``: tensors filled with a sentinel, other leaves unset."""

    def walk(t):
        if isinstance(t, torch.Tensor):  # differs from ``ref`` in every element
            return torch.logical_not(t) if t.dtype == torch.bool else t + 1
        if isinstance(t, dict):
            return {k: walk(v) for k, v in t.items()}
        if isinstance(t, list):
            return [walk(v) for v in t]
        return NOT_LOADED

    return walk(ref)


def assert_same(actual: Any, expected: Any, path: str = "") -> None:
    """Exact equality: tensor type, dtype, shape and every value (``torch.equal``)."""
    from torch.distributed.tensor import DTensor

    where = path or "<root>"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual).__name__}"
        if isinstance(actual, DTensor):
            actual = actual.full_tensor()
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert torch.equal(actual, expected), f"{where}: values differ\n{actual}\n!=\n{expected}"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: expected a dict, got {type(actual).__name__}"
        assert sorted(map(str, actual)) == sorted(map(str, expected)), (
            f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        )
        for k in expected:
            assert_same(actual[k], expected[k], f"{path}.{k}" if path else str(k))
    elif isinstance(expected, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict)) for v in expected):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}.{i}")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# -- the 2-rank save worker ---------------------------------------------------------------------
def _save_worker(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    root_path = Path(root)
    mesh = init_device_mesh("cpu", (world_size,))
    for name in SAVE_SCENARIOS:
        globals()[f"_scenario_{name}"](rank, mesh, root_path)
        dist.barrier()
        if rank == 0:
            (root_path / f"done-{name}").touch()


def _scenario_fsdp(rank: int, mesh, root: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _fsdp(0, mesh)
    _train(model, optim, 2, seed=10)
    ref = _full_state(model, optim)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=CheckpointWriter(root / "fsdp"))
    if rank == 0:
        torch.save(ref, root / "ref-fsdp.pt")
    # Same world size, fresh model: catches a broken save before the resharding checks run.
    _load_fsdp_and_check(mesh, root / "fsdp", ref, seed=99)


def _load_fsdp_and_check(mesh, path: Path, ref: dict[str, Any], seed: int) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = _fsdp(seed, mesh)
    for group in optim.param_groups:
        group["lr"] = 0.5  # must come back from the checkpoint
    msd, osd = get_state_dict(model, optim)  # initializes the Adam state
    dcp.load({"model": msd, "optim": osd}, storage_reader=CheckpointReader(path))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    assert_same(_full_state(model, optim), ref)


def _scenario_dtensor(rank: int, mesh, root: Path) -> None:
    ref = dtensor_reference()
    sd = {"dt": _distribute(ref, mesh, SAVE_PLACEMENTS), "extra": {"step": 7, "name": "two-rank"}}
    # Small hash chunks: resharded loads then read strided sub-ranges across chunk boundaries;
    # several files per rank: items are spread over them.
    dcp.save(sd, storage_writer=CheckpointWriter(root / "dtensor", chunk_size=4096, files_per_rank=3))
    target = {"dt": _distribute(plain_target(ref), mesh, SAVE_PLACEMENTS), "extra": {"step": -1, "name": ""}}
    dcp.load(target, storage_reader=CheckpointReader(root / "dtensor"))
    assert_same(target, {"dt": ref, "extra": {"step": 7, "name": "two-rank"}})


def _mutate(model: nn.Module, optim: torch.optim.Optimizer, dts: dict[str, Any]) -> None:
    """Change every saved value in place, as training does after async_save returns."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        for st in optim.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    v.add_(1)
        for v in dts.values():
            if v.dtype == torch.bool:
                v.logical_not_()
            else:
                v.add_(1)


def _async_state(mesh, seed: int):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _fsdp(seed, mesh)
    _train(model, optim, 1, seed=seed)
    dts = _distribute(dtensor_reference(), mesh, SAVE_PLACEMENTS)
    msd, osd = get_state_dict(model, optim)
    extra = {"seed": seed}
    return model, optim, dts, {"model": msd, "optim": osd, "dt": dts, "extra": extra}


def _check_mutated(sd: dict[str, Any], before: dict[str, Any]) -> None:
    """The mutation must be visible through the very state dict given to async_save."""
    after = dict(_tensors(_full_from_sharded(sd)))
    for path, t in _tensors(before):
        assert not torch.equal(after[path], t), f"{path}: _mutate did not reach the saved state dict"


def _full_from_sharded(sd: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    return _map_tensors(sd, lambda t: t.full_tensor() if isinstance(t, DTensor) else t.clone())


def _load_async_and_check(model, optim, dts, path: Path, before: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optim)
    target = {"model": msd, "optim": osd, "dt": dts, "extra": {"seed": -1}}
    dcp.load(target, storage_reader=CheckpointReader(path))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    assert_same(_full_state(model, optim, dts, target["extra"]), before)


def _async_round_trip(rank: int, mesh, root: Path, name: str, kind, seed: int, process_group=None) -> None:
    model, optim, dts, sd = _async_state(mesh, seed)
    before = _full_state(model, optim, dts, sd["extra"])
    fut = dcp.async_save(
        sd, storage_writer=CheckpointWriter(root / name), async_checkpointer_type=kind, process_group=process_group
    )
    _mutate(model, optim, dts)  # at once: the write has not even been planned yet
    sd["extra"]["seed"] = -5
    fut.result(timeout=120)
    _check_mutated(sd, before)
    _load_async_and_check(model, optim, dts, root / name, before)
    if rank == 0:
        torch.save(before, root / f"ref-{name}.pt")


def _scenario_async_thread(rank: int, mesh, root: Path) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    # A dedicated gloo group, as on GPU machines where the default group is NCCL.
    pg = dist.new_group(backend="gloo")
    _async_round_trip(rank, mesh, root, "async_thread", AsyncCheckpointerType.THREAD, seed=20, process_group=pg)


def _scenario_async_process(rank: int, mesh, root: Path) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    _async_round_trip(rank, mesh, root, "async_process", AsyncCheckpointerType.PROCESS, seed=30)


def _scenario_save_errors(rank: int, mesh, root: Path) -> None:
    """A refused save fails on every rank, through every executor, with our error inside it,
    and leaves the writer ready for the next save.

    Runs before ``checkpoint_id`` so that the process executor is shown to serve again after a
    failed save; the 1-process test then shows the refused location still loads.
    """
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    sd = {"x": torch.arange(3) + rank, "y": torch.ones(2, 2)}
    writer = CheckpointWriter(root / "fsdp")  # committed above, and overwrite=False
    for kind in (None, AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
        try:
            if kind is None:
                dcp.save(sd, storage_writer=writer)
            else:
                dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=kind).result(timeout=120)
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            err = find_checkpoint_error(e)
            assert isinstance(err, CheckpointExistsError), f"{kind}: expected CheckpointExistsError in {e!r}"
            assert err.path and "fsdp" in err.path, f"{kind}: the error does not name the location: {err.path!r}"
        else:
            raise AssertionError(f"{kind}: saving over a committed checkpoint did not fail")
    # The failed saves leave the writer usable, from any thread.
    expected = {"x": torch.arange(3), "y": torch.ones(2, 2)}  # plain tensors: rank 0's copy
    dcp.async_save(sd, checkpoint_id=root / "after-errors", storage_writer=writer).result(timeout=120)
    target = plain_target(expected)
    dcp.load(target, storage_reader=CheckpointReader(root / "after-errors"))
    assert_same(target, expected)


def _scenario_checkpoint_id(rank: int, mesh, root: Path) -> None:
    """One writer, three sequential saves that each name their location with checkpoint_id=."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    model, optim, dts, sd = _async_state(mesh, seed=40)
    writer = CheckpointWriter(root / "id-unused")
    refs = {}
    saves = [
        ("id-sync", str(root / "id-sync"), None),  # a str checkpoint_id
        ("id-thread", root / "id-thread", AsyncCheckpointerType.THREAD),  # an os.PathLike one
        ("id-process", root / "id-process", AsyncCheckpointerType.PROCESS),
    ]
    for i, (name, ckpt_id, kind) in enumerate(saves):
        sd["extra"]["seed"] = i
        refs[name] = _full_state(model, optim, dts, sd["extra"])
        if kind is None:
            dcp.save(sd, checkpoint_id=ckpt_id, storage_writer=writer)
        else:
            fut = dcp.async_save(sd, checkpoint_id=ckpt_id, storage_writer=writer, async_checkpointer_type=kind)
            _mutate(model, optim, dts)
            fut.result(timeout=120)
        _mutate(model, optim, dts)
    for name, _, _ in saves:
        _load_async_and_check(model, optim, dts, root / name, refs[name])
        if rank == 0:
            torch.save(refs[name], root / f"ref-{name}.pt")
    assert not (root / "id-unused" / "manifest.json").exists(), "checkpoint_id= was ignored"


# -- the 3-rank load worker ---------------------------------------------------------------------
def _load_worker(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    root_path = Path(root)
    mesh = init_device_mesh("cpu", (world_size,))
    ref = torch.load(root_path / "ref-fsdp.pt", weights_only=True)
    _load_fsdp_and_check(mesh, root_path / "fsdp", ref, seed=77)

    full = dtensor_reference()
    reader = CheckpointReader(root_path / "fsdp")  # reused through checkpoint_id= (reset())
    for placements in LOAD_PLACEMENTS:
        target = {"dt": _distribute(plain_target(full), mesh, placements), "extra": {"step": -1, "name": ""}}
        dcp.load(target, checkpoint_id=root_path / "dtensor", storage_reader=reader)
        for k, v in target["dt"].items():
            assert v.placements == tuple(_placements(placements[k])), f"{k}: placements changed"
            assert v.to_local().shape == _expected_local_shape(full[k].shape, placements[k], rank, world_size), k
        assert_same(target, {"dt": full, "extra": {"step": 7, "name": "two-rank"}})

    # The async checkpoint of the process executor, resharded to 3 ranks as well.
    before = torch.load(root_path / "ref-async_process.pt", weights_only=True)
    model, optim, dts, _ = _async_state(mesh, seed=88)
    _load_async_and_check(model, optim, dts, root_path / "async_process", before)


def _expected_local_shape(shape, dims, rank, world_size):
    shape = list(shape)
    if dims:
        d = dims[0]
        chunk = -(-shape[d] // world_size)
        shape[d] = max(0, min(chunk, shape[d] - rank * chunk))
    return torch.Size(shape)


# -- pytest --------------------------------------------------------------------------------------
@dataclass
class SaveRun:
    root: Path
    error: str | None

    def require(self, *names: str) -> None:
        missing = [n for n in names if not (self.root / f"done-{n}").exists()]
        if missing:
            pytest.fail(
                f"save scenario(s) {', '.join(missing)} did not complete:\n{self.error or '(no error reported)'}",
                pytrace=False,
            )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> SaveRun:
    root = tmp_path_factory.mktemp("multirank")
    try:
        run_ranks(_save_worker, 2, str(root), report_dir=root / "reports-save", timeout=240)
    except AssertionError as e:
        return SaveRun(root, str(e))
    return SaveRun(root, None)


@pytest.mark.multiproc
@pytest.mark.parametrize("scenario", SAVE_SCENARIOS)
def test_two_rank_save(saved: SaveRun, scenario: str) -> None:
    """Each scenario saved, and reloaded on the same 2 ranks, with exactly equal values."""
    saved.require(scenario)


_SINGLE_PROCESS_WARNING = "ignore:torch.distributed is disabled:UserWarning"


@pytest.mark.multiproc
@pytest.mark.filterwarnings(_SINGLE_PROCESS_WARNING)
def test_load_in_one_process_as_plain_tensors(saved: SaveRun) -> None:
    """Without a process group, every 2-rank checkpoint loads into full plain tensors."""
    assert not dist.is_initialized(), "a default process group was left initialized in the test process"
    saved.require(*SAVE_SCENARIOS)
    cases = {"fsdp": "ref-fsdp.pt"}
    cases.update({n: f"ref-{n}.pt" for n in ("async_thread", "async_process", "id-sync", "id-thread", "id-process")})
    for name, ref_file in cases.items():
        ref = torch.load(saved.root / ref_file, weights_only=True)
        target = plain_target(ref)
        dcp.load(target, storage_reader=CheckpointReader(saved.root / name))
        assert_same(target, ref, name)

    full = dtensor_reference()
    target = {"dt": plain_target(full), "extra": {"step": -1, "name": ""}}
    dcp.load(target, storage_reader=CheckpointReader(saved.root / "dtensor"))
    assert_same(target, {"dt": full, "extra": {"step": 7, "name": "two-rank"}})


@pytest.mark.multiproc
@pytest.mark.filterwarnings(_SINGLE_PROCESS_WARNING)
def test_resume_fsdp_checkpoint_in_one_process(saved: SaveRun) -> None:
    """The FSDP2 model+Adam checkpoint resumes an unsharded model and optimizer."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    saved.require("fsdp")
    model = _model(seed=5)
    optim = torch.optim.Adam(model.parameters(), lr=0.5)
    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, storage_reader=CheckpointReader(saved.root / "fsdp"))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    assert_same(_full_state(model, optim), torch.load(saved.root / "ref-fsdp.pt", weights_only=True))


@pytest.mark.multiproc
def test_load_in_three_ranks_resharded(saved: SaveRun) -> None:
    """3 ranks, other placements and uneven splits: FSDP2 model+Adam, DTensors, async state."""
    saved.require("fsdp", "dtensor", "async_process")
    run_ranks(_load_worker, 3, str(saved.root), report_dir=saved.root / "reports-load", timeout=240)


def test_async_save_without_process_group(tmp_path: Path) -> None:
    """Single process, thread executor: mutations after async_save returns are not saved."""
    assert not dist.is_initialized(), "a default process group was left initialized in the test process"
    g = torch.Generator().manual_seed(5)
    sd = {
        "w": torch.randn(64, 33, generator=g),
        "half": torch.randn(17, generator=g).to(torch.bfloat16),
        "nested": {"ids": torch.arange(10), "view": torch.randn(8, 8, generator=g).t()[2:6]},
        "meta": {"step": 3},
    }
    before = _map_tensors(copy.deepcopy(sd), lambda t: t.clone())
    writer = CheckpointWriter(tmp_path / "unused")
    for i, ckpt in enumerate([tmp_path / "a", tmp_path / "b"]):
        expected = _map_tensors(copy.deepcopy(sd), lambda t: t.clone())
        fut = dcp.async_save(sd, checkpoint_id=ckpt, storage_writer=writer)
        for _, t in _tensors(sd):
            t.add_(1)
        sd["meta"]["step"] += 1
        fut.result(timeout=60)
        target = plain_target(expected)
        dcp.load(target, storage_reader=CheckpointReader(ckpt))
        assert_same(target, expected, f"save {i}")
    assert not torch.equal(before["w"], sd["w"])
    assert not (tmp_path / "unused" / "manifest.json").exists()


class _FailingPlanner(dcp.DefaultSavePlanner):
    """Fails after the writer has claimed the save, outside any writer method."""

    def __init__(self, go: threading.Event | None = None) -> None:
        super().__init__()
        self._go = go

    def create_local_plan(self):
        if self._go is not None:
            self._go.wait(30)
        raise ValueError("planner failed on purpose")


def test_async_save_after_failed_saves_on_one_writer(tmp_path: Path) -> None:
    """Saves that fail between the writer's calls do not lock the writer for the next save."""
    sd = {"w": torch.arange(6.0)}
    writer = CheckpointWriter(tmp_path / "unused")

    # A failed synchronous save on this thread, then an async save from this thread.
    with pytest.raises(BaseException, match="planner failed"):
        dcp.save(sd, checkpoint_id=tmp_path / "bad-sync", storage_writer=writer, planner=_FailingPlanner())
    dcp.async_save(sd, checkpoint_id=tmp_path / "ok-1", storage_writer=writer).result(timeout=60)

    # A failed async save whose executor thread is still alive when the caller retries.
    go = threading.Event()
    fut = dcp.async_save(sd, checkpoint_id=tmp_path / "bad-async", storage_writer=writer, planner=_FailingPlanner(go))
    fut.add_done_callback(lambda _: time.sleep(0.5))  # runs on that thread, after result() wakes
    go.set()
    with pytest.raises(BaseException, match="planner failed"):
        fut.result(timeout=60)
    dcp.async_save(sd, checkpoint_id=tmp_path / "ok-2", storage_writer=writer).result(timeout=60)

    for name in ("ok-1", "ok-2"):
        target = plain_target(sd)
        dcp.load(target, storage_reader=CheckpointReader(tmp_path / name))
        assert_same(target, sd, name)
