"""Hostile saved loader state through ``CheckpointManager.restore`` (issue 33): each case is
refused by name before the restore applies anything, on the same-topology path and on the
elastic one, and the live optimizer, generators, loader, sampler and other stateful objects are
unchanged after the refusal.

The model's and optimizer's tensors are read by ``dcp.load`` into the live ones
(``state.modules``), so the restore reads them only once every rank's per-rank rows are decoded
and checked (``state.apply``): after a refusal they are bit-identical to before, on one tier and
on two, in one process and in two. The unit cases, with their counted work, are
tests/data/test_saved_state_hostile.py.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.datasets import Ids as _Ids
from helpers.hostile_states import cyclic as _cyclic
from helpers.hostile_states import deflated as _deflated
from helpers.samples import item_range, rewrite_manifest
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from goodput_ckpt import CheckpointManager
from goodput_ckpt.data import ElasticSampler, TokenStream
from goodput_ckpt.engine.untrusted_load import MAX_INFLATION
from goodput_ckpt.errors import CheckpointError, CorruptCheckpointError
from goodput_ckpt.state import META_KEY
from goodput_ckpt.state.dataloader import ROW_HEADER

N, BATCH = 56, 4


def Ids() -> _Ids:  # noqa: N802 - the dataset of N samples these tests use
    return _Ids(N)


class SavedLoader:
    """Saves ``state`` as its loader state; its sampler marks the metadata elastic."""

    num_workers = 0

    def __init__(self, state: dict, batch_size: int = BATCH) -> None:
        self.state, self.batch_size, self.sampler = state, batch_size, ElasticSampler(Ids(), seed=3)

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


class Recorder:
    """Another stateful object: it must not be loaded when the restore is refused."""

    def __init__(self) -> None:
        self.loaded = 0

    def state_dict(self) -> dict:
        return {"v": torch.zeros(2)}

    def load_state_dict(self, state: dict) -> None:
        self.loaded += 1


def _real_state() -> dict:
    ld = StatefulDataLoader(Ids(), batch_size=BATCH, sampler=ElasticSampler(Ids(), seed=3), num_workers=0)
    it = iter(ld)
    for _ in range(3):
        next(it)
    return ld.state_dict()


def _set(field: str, value):
    def apply(ls: dict) -> None:
        if field.startswith("/"):
            ls[field[1:]] = value
            return
        st, _ = ElasticSampler.find_state(ls)
        *parents, last = field.split(".")
        for p in parents:
            st = st[p]
        st[last] = value

    return apply


def _v1_done(done):
    """A version-1 state (still read) whose bitmap is ``done``."""

    def apply(ls: dict) -> None:
        st, _ = ElasticSampler.find_state(ls)
        st["goodput_elastic_sampler"] = 1
        st["position"] = {"epoch": st["position"]["epoch"], "segments": [], "done": done}

    return apply


CASES = [
    ("consumed_minus_1", _set("consumed", -1), CorruptCheckpointError, "consumed"),
    ("consumed_huge", _set("consumed", 10**6), CorruptCheckpointError, "consumed"),
    ("since_minus_12", _set("/_steps_since_snapshot", -12), CorruptCheckpointError, "_steps_since_snapshot"),
    ("epoch_2_70", _set("position.epoch", 2**70), CorruptCheckpointError, "epoch"),
    ("epoch_inf", _set("position.epoch", float("inf")), CorruptCheckpointError, "epoch"),
    ("start_past_epoch", _set("position.start", 10**9), CorruptCheckpointError, "start"),
    ("taken_a_million", _set("position.taken", list(range(1, 10**6))), CorruptCheckpointError, "taken"),
    (
        "v1_done_stride0",
        _v1_done(torch.zeros(1, dtype=torch.uint8).expand(1 << 20)),  # 1 MiB from a byte
        CorruptCheckpointError,
        "'done' bitmap",
    ),
    ("cycle", _set("/dataset_state", _cyclic()), CorruptCheckpointError, "contains itself"),
]


def _model_and_optimizer(lr: float, seed: int = 0):
    """A model and an optimizer with state (a momentum buffer); ``seed`` decides the values, so
    that a restore target differs from what was saved."""
    torch.manual_seed(seed)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model(torch.randn(3, 2)).sum().backward()
    opt.step()
    return model, opt


def _live_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Copies of every tensor the restore would read into: parameters and optimizer states."""
    states = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return [t.detach().clone() for t in [*model.parameters(), *states]]


def _assert_bit_identical(before: list[torch.Tensor], model: nn.Module, opt: torch.optim.Optimizer) -> None:
    after = _live_tensors(model, opt)
    assert len(after) == len(before) and all(
        a.dtype == b.dtype and a.shape == b.shape and a.view(torch.uint8).equal(b.view(torch.uint8))
        for a, b in zip(after, before)
    ), "the live model's and optimizer's tensors are unchanged"


def _target(batch: int):
    sampler = ElasticSampler(Ids(), seed=3)
    loader = StatefulDataLoader(Ids(), batch_size=batch, sampler=sampler, num_workers=0)
    it = iter(loader)
    next(it)
    return loader, sampler, it


def _assert_refused_and_unchanged(mgr, error, match, batch):
    model, opt = _model_and_optimizer(0.5, seed=1)  # other weights than the saved ones
    tensors = _live_tensors(model, opt)
    loader, sampler, it = _target(batch)
    recorder = Recorder()
    random.seed(7)
    torch.manual_seed(8)
    before = (
        copy.deepcopy(loader.state_dict()),
        sampler.epoch,
        sampler._pending,
        random.getstate(),
        torch.get_rng_state(),
    )
    with pytest.raises(error, match=match):
        mgr.restore(model=model, optimizer=opt, dataloader=loader, recorder=recorder)
    assert opt.param_groups[0]["lr"] == 0.5, "the optimizer's param groups were not loaded"
    _assert_bit_identical(tensors, model, opt)
    assert recorder.loaded == 0, "no stateful object was loaded"
    assert loader.state_dict() == before[0] and (sampler.epoch, sampler._pending) == before[1:3], "loader unchanged"
    assert random.getstate() == before[3] and torch.equal(torch.get_rng_state(), before[4]), "generators unchanged"
    assert next(it).tolist() == list(ElasticSampler(Ids(), seed=3))[batch : 2 * batch], "it reads on where it was"


def _save(root: Path, state: dict, batch_size: int = BATCH, **options) -> CheckpointManager:
    mgr = CheckpointManager(root, async_save=False, **options)
    model, opt = _model_and_optimizer(0.1)
    mgr.save(1, model=model, optimizer=opt, dataloader=SavedLoader(state, batch_size), recorder=Recorder())
    return mgr


@pytest.mark.parametrize("path", ["same_topology", "elastic"])
@pytest.mark.parametrize(("case", "mutate", "error", "match"), CASES, ids=[c[0] for c in CASES])
def test_a_hostile_loader_state_is_refused_before_anything_is_applied(tmp_path, path, case, mutate, error, match):
    state = _real_state()
    mutate(state)
    with _save(tmp_path, state) as mgr:
        # Another batch size makes the restore elastic (no flag); the same one restores in place.
        _assert_refused_and_unchanged(mgr, error, match, BATCH if path == "same_topology" else 3)


@pytest.mark.parametrize("path", ["same_topology", "elastic"])
@pytest.mark.parametrize(("case", "mutate", "error", "match"), CASES[:1] + CASES[-1:], ids=[CASES[0][0], CASES[-1][0]])
def test_a_hostile_loader_state_is_refused_on_two_tiers_before_anything_is_read(
    tmp_path, path, case, mutate, error, match
):
    """The two-tier restore (local copy, persistent root) loads in the same two parts."""
    state = _real_state()
    mutate(state)
    with _save(tmp_path / "root", state, local_dir=str(tmp_path / "local")) as mgr:
        mgr.wait()  # persisted too
        assert mgr.step_tiers() == {1: ("local", "persistent")}
        _assert_refused_and_unchanged(mgr, error, match, BATCH if path == "same_topology" else 3)


def test_a_negative_or_string_batch_size_in_the_metadata_is_refused(tmp_path):
    state = _real_state()
    state["_steps_since_snapshot"] = 1 << 20  # with "xxxxxxxx": an 8 MiB string before the fix
    with _save(tmp_path, state, batch_size=-1) as mgr:
        _assert_refused_and_unchanged(mgr, CorruptCheckpointError, "batch_size", 3)
        step = tmp_path / "step_00000001"
        doc = json.loads((step / "manifest.json").read_text())
        doc["metadata"][META_KEY]["dataloader"]["batch_size"] = "xxxxxxxx"
        rewrite_manifest(step, doc)
        _assert_refused_and_unchanged(mgr, CorruptCheckpointError, "batch_size", 3)


def test_a_deflate_bomb_in_the_loader_row_is_refused(tmp_path):
    """Written by a hostile writer (hashes that match: here, verification off)."""
    state = {**_real_state(), "pad": b"\1" * 200_000}  # a row wide enough to hold the bomb
    bomb = _deflated({"x": b"\0" * (8 * MAX_INFLATION)})
    mgr = CheckpointManager(tmp_path, async_save=False, verify=False)
    model, opt = _model_and_optimizer(0.1)
    mgr.save(1, model=model, optimizer=opt, dataloader=SavedLoader(state), recorder=Recorder())
    step = tmp_path / "step_00000001"
    name, offset, length = item_range(step, "dataloader.rows")
    assert ROW_HEADER + len(bomb) < length
    with open(step / name, "r+b") as f:
        f.seek(offset)
        f.write(len(bomb).to_bytes(ROW_HEADER, "little") + bomb)
    with mgr:
        _assert_refused_and_unchanged(mgr, CorruptCheckpointError, r"dataloader\.rows\[0\].*decode to", BATCH)


def test_an_rng_slot_name_outside_ascii_is_refused(tmp_path):
    with _save(tmp_path, _real_state()) as mgr:
        step = tmp_path / "step_00000001"
        doc = json.loads((step / "manifest.json").read_text())
        doc["metadata"][META_KEY]["rng"]["layout"].append(["cuda²", "uint8", 16])
        rewrite_manifest(step, doc)
        _assert_refused_and_unchanged(mgr, CorruptCheckpointError, "cuda²", BATCH)


def test_a_replaced_token_shard_is_refused_by_name(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for k, n in enumerate([5, 9]):
        (shards / f"s{k}.bin").write_bytes(np.arange(n * 8, dtype=np.uint16).tobytes())
    names = ["s0.bin", "s1.bin"]
    loader = StatefulDataLoader(TokenStream(str(shards), names, seq_len=8, block=2), batch_size=2, num_workers=0)
    it = iter(loader)
    next(it), next(it)
    model, opt = _model_and_optimizer(0.1)
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, model=model, optimizer=opt, dataloader=loader)
        (shards / "s0.bin").write_bytes(np.arange(7 * 8, dtype=np.uint16).tobytes())  # replaced, 7 sequences
        fresh = StatefulDataLoader(TokenStream(str(shards), names, seq_len=8, block=2), batch_size=2, num_workers=0)
        model, opt = _model_and_optimizer(0.5)
        with pytest.raises(CheckpointError, match="'s0.bin' is 112 bytes, 80 when the state was saved"):
            mgr.restore(model=model, optimizer=opt, dataloader=fresh)
        assert opt.param_groups[0]["lr"] == 0.5
        assert len(list(fresh)) == 8, "the fresh stream reads from its start (7 + 9 sequences, 2 a batch)"


def _one_bad_row(rank: int, world: int, root: str, local_dir: str | None = None) -> None:
    def loader():
        sampler = ElasticSampler(Ids(), seed=3, num_replicas=world, rank=rank)
        return StatefulDataLoader(Ids(), batch_size=BATCH, sampler=sampler, num_workers=0), sampler

    ld, sampler = loader()
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    if rank == 1:
        _set("consumed", -1)(state)
    saving = SavedLoader(state)
    saving.sampler = sampler
    model, opt = _model_and_optimizer(0.1)
    with CheckpointManager(root, async_save=False, local_dir=local_dir) as mgr:
        mgr.save(1, model=model, optimizer=opt, dataloader=saving)
        target, _ = loader()
        before = copy.deepcopy(target.state_dict())
        model, opt = _model_and_optimizer(0.5, seed=1)  # other weights than the saved ones
        tensors = _live_tensors(model, opt)
        with pytest.raises(CheckpointError, match=r"dataloader row of rank 1.*consumed"):
            mgr.restore(model=model, optimizer=opt, dataloader=target)
        assert opt.param_groups[0]["lr"] == 0.5 and target.state_dict() == before
        # Rank 0's own row is good: it is refused before its tensors are read all the same.
        _assert_bit_identical(tensors, model, opt)


def _one_bad_row_each(rank: int, world: int, cases: list[tuple[str, str | None]]) -> None:
    """``_one_bad_row`` for each (root, local_dir) in one gloo job (a group costs 10-30 s to start
    on 2 cores); each case writes its marker once every rank passed it."""
    import torch.distributed as dist

    from goodput_ckpt.dcp.commit_build import forget_layouts

    for root, local_dir in cases:
        forget_layouts()  # each case saves as in a fresh process
        _one_bad_row(rank, world, root, local_dir)
        dist.barrier()
        if rank == 0:
            Path(root, "passed").write_text("")


@pytest.fixture(scope="module")
def bad_row_roots(tmp_path_factory) -> dict[str, Path]:
    """ "one-tier" and "two-tier": the root each case ran in (``passed`` in it once it passed on
    every rank). A rank's failure fails both tests, with its traceback."""
    from helpers.dist import run_ranks

    base = tmp_path_factory.mktemp("bad_row")
    roots = {"one-tier": (base / "run1", None), "two-tier": (base / "run2", str(base / "local"))}
    run_ranks(
        _one_bad_row_each,
        2,
        [(str(root), local) for root, local in roots.values()],
        report_dir=base / "report",
        timeout=280,
    )
    return {name: root for name, (root, _) in roots.items()}


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_one_ranks_bad_row_fails_the_restore_on_every_rank(bad_row_roots):
    """Checked in DCP's read phase: rank 0, whose own row is good, is refused too, by rank 1's
    row, instead of training on while rank 1 fails."""
    assert (bad_row_roots["one-tier"] / "passed").exists()


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_one_ranks_bad_row_fails_the_two_tier_restore_on_every_rank(bad_row_roots):
    assert (bad_row_roots["two-tier"] / "passed").exists()
