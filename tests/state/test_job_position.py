"""The data position as one job-level entry (issue 34): the ElasticSampler's global record is
written once per job, in the commit record's training-state metadata, and every rank's
dataloader row keeps only its own count; restores of checkpoints whose rows still hold the whole
record (``fixtures/v2_rows``, written by the package before, ``make_v2_rows.py``) give back what
that package gave."""

from __future__ import annotations

import copy
import json
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.datasets import Ids
from helpers.dist import run_ranks
from helpers.samples import rewrite_manifest
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from goodput_ckpt import CheckpointManager, CheckpointReader
from goodput_ckpt.data import ElasticSampler, GlobalPosition, TokenStream
from goodput_ckpt.data.position import epoch_order
from goodput_ckpt.data.sampler import MARK
from goodput_ckpt.data.tokens import MARK as TS_MARK
from goodput_ckpt.errors import CheckpointError, CorruptCheckpointError, TopologyChangeError
from goodput_ckpt.state import META_KEY, Topology, build_save_state, normalize
from goodput_ckpt.state.dataloader import decode_dataloader_row

FIXTURE = Path(__file__).parent / "fixtures" / "v2_rows"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text()) if FIXTURE.exists() else {}
N = 40


def _loader(batch: int, ws: int = 1, rank: int = 0, n: int = N) -> tuple[StatefulDataLoader, ElasticSampler]:
    s = ElasticSampler(Ids(n), seed=5, num_replicas=ws, rank=rank)
    return StatefulDataLoader(Ids(n), batch_size=batch, sampler=s), s


def _ids(batches) -> list[int]:
    return [int(i) for b in batches for i in b]


def _restored(root: Path, batch: int) -> list[int]:
    data, _ = _loader(batch)
    with CheckpointManager(root, async_save=False) as mgr:
        assert mgr.restore(model=nn.Linear(2, 2), dataloader=data) == 7
    return _ids(data)


@pytest.mark.parametrize(("name", "batch", "kind"), [("ws1", 4, "same"), ("ws1", 2, "elastic"), ("ws2", 2, "elastic")])
def test_a_checkpoint_with_the_record_in_every_row_restores_as_before(tmp_path, name, batch, kind):
    case = EXPECTED[name]
    root = tmp_path / name
    shutil.copytree(FIXTURE / name, root)
    want = case["same"][0] if kind == "same" else case["elastic"]["1"][0]
    assert _restored(root, batch) == want


# -- what a save stores -------------------------------------------------------------------------
def _rows(step: Path) -> tuple[dict, list]:
    """The committed training-state metadata and every rank's decoded loader row."""
    reader = CheckpointReader(str(step))
    entry = reader.manifest.items["dataloader.rows"]
    dest = {"dataloader": {"rows": torch.empty(entry.shape, dtype=torch.uint8)}}
    dcp.load(dest, storage_reader=reader, no_dist=True)
    rows = [decode_dataloader_row(row, key=f"row {r}") for r, row in enumerate(dest["dataloader"]["rows"])]
    return reader.manifest.metadata[META_KEY], rows


def _save(root: Path, steps: int = 3, batch: int = 4) -> list[int]:
    data, s = _loader(batch)
    s.set_epoch(2)
    it = iter(data)
    for _ in range(steps):
        next(it)
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(7, model=nn.Linear(2, 2), dataloader=data)
    return _ids(it)


def test_the_record_is_in_the_commit_record_once_and_the_row_keeps_its_count(tmp_path):
    rest = _save(tmp_path)
    meta, rows = _rows(tmp_path / "step_00000007")
    job = meta["dataloader"]["job_position"]
    assert job["position"] == {"epoch": 2, "start": 0, "taken": []} and job["world_size"] == 1
    part, _ = ElasticSampler.find_state(rows[0])
    assert set(part) == {MARK, "rank", "consumed", "job"} and part["consumed"] == 12
    assert _restored(tmp_path, 4) == rest, "same topology: the row joined to the record"
    assert _restored(tmp_path, 3) == rest, "elastic (another batch size): the same samples"


def _saved_rows(n: int, world: int, position: dict) -> tuple[dict, list[torch.Tensor]]:
    """What ``build_save_state`` (the save's own function) makes on each of ``world`` simulated
    ranks whose sampler iterators stand at ``position``: the coordinator's metadata (the one
    committed) and every rank's row. The iterator state of rank ``r`` is rank 0's with its own
    rank and count (what ``_ElasticIterator.state_dict`` returns there), so that the 10 M-sample
    permutation is drawn once, not once per simulated rank."""
    base = {**iter(ElasticSampler(Ids(n), seed=1, num_replicas=world, rank=0)).state_dict(), "position": position}
    rows, meta = [], None
    for r in range(world):
        loader = _StateLoader({"_sampler_iter_state": {**base, "rank": r, "consumed": 3}, "_num_yielded": 3})
        loader.sampler = ElasticSampler(Ids(n), seed=1, num_replicas=world, rank=r)
        state, m = build_save_state(
            7,
            models=normalize(nn.Linear(1, 1), None),
            dataloader=loader,
            stateful={},
            topology=Topology(r, world),
            save_rng=False,
            extra=None,
        )
        rows.append(state["dataloader"]["rows"].row)
        meta = meta or m[META_KEY]
    return meta, rows


class _StateLoader:
    num_workers, batch_size = 0, 1

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def test_state_size_after_40_restarts_at_1024_simulated_ranks_is_at_most_4_kb_per_job():
    """Acceptance (issue 34), on what the checkpoint stores: 40 restarts at world sizes up to
    1,024 over 10 M samples, then a save by 1,024 simulated ranks. The data position is one
    record in the commit record (JSON, at most 4 KB); each rank's row holds its count and the
    record's digest, the same few bytes whatever the history."""
    n, rng = 10_000_000, random.Random(34)
    pos = GlobalPosition(0)
    for k in range(40):
        w = 1024 if k % 2 == 0 else rng.randint(1, 1024)
        counts = [rng.randint(3, 5)] * w
        if k % 5 == 4:  # now and then the ranks were not in step: a few exceptions
            counts[rng.randrange(w)] += 2
        pos = pos.advanced(w, counts, n)
    assert pos.taken, "the history left exceptions in the record"
    meta, rows = _saved_rows(n, 1024, pos.to_state())
    job = json.dumps(meta["dataloader"]["job_position"]).encode()
    assert len(job) <= 4096, f"the job-level record is {len(job)} bytes"
    parts = [ElasticSampler.find_state(decode_dataloader_row(row, key="r"))[0] for row in rows]
    assert all(set(p) == {MARK, "rank", "consumed", "job"} for p in parts), "no row holds the record"
    assert len({p["job"] for p in parts}) == 1
    per_rank = max(len(pickle.dumps(p, protocol=2)) for p in parts)
    print(f"job-level record {len(job)} B, a row's sampler part {per_rank} B, row {rows[0].numel()} B")
    assert per_rank <= 128, f"a row's sampler part is {per_rank} bytes"
    # The same save at the start of the epoch: rows as wide, whatever the history.
    _, fresh = _saved_rows(n, 2, GlobalPosition(0).to_state())
    assert rows[0].numel() == fresh[0].numel(), "a row's size does not depend on the history"
    # ... and it restores: a new rank of 1,000 joins a row to the record and resumes.
    s = ElasticSampler(Ids(n), seed=1, num_replicas=1000, rank=999)
    states = [s.join_job_state(decode_dataloader_row(row, key="r"), meta["dataloader"]["job_position"]) for row in rows]
    s.elastic_resume(states, batch_size=1)
    assert s._next_position() == pos.advanced(1024, [3] * 1024, n)


# -- a hostile job-level record ------------------------------------------------------------------
def _edit_job(step: Path, edit) -> None:
    doc = json.loads((step / "manifest.json").read_text())
    dl = doc["metadata"][META_KEY]["dataloader"]
    edit(dl)
    rewrite_manifest(step, doc)


def _set_job(path: str, value):
    def edit(dl: dict) -> None:
        *parents, last = path.split(".")
        d = dl
        for p in parents:
            d = d[p]
        d[last] = value

    return edit


JOB_CASES = [
    ("missing", lambda dl: dl.pop("job_position"), CorruptCheckpointError, "no job-level record"),
    ("not_an_object", _set_job("job_position", "x"), CorruptCheckpointError, "must be an object"),
    ("extra_key", _set_job("job_position.x", 1), CorruptCheckpointError, "must be an object"),
    ("taken_10000", _set_job("job_position.position.taken", list(range(13, 10_013))), CorruptCheckpointError, "taken"),
    ("start_float", _set_job("job_position.position.start", 1.5), CorruptCheckpointError, "start"),
    ("epoch_2_70", _set_job("job_position.position.epoch", 2**70), CorruptCheckpointError, "epoch"),
    ("world_size_2_40", _set_job("job_position.world_size", 2**40), CorruptCheckpointError, "world_size"),
    ("another_sampler", _set_job("job_position.seed", 6), CheckpointError, "differs from the saved one"),
    # Well-formed, but not the record the rows were split from: another save's, or another job's.
    ("another_record", _set_job("job_position.position.start", 8), TopologyChangeError, "not the job's"),
]


@pytest.mark.parametrize("path", ["same_topology", "elastic"])
@pytest.mark.parametrize(("case", "edit", "error", "match"), JOB_CASES, ids=[c[0] for c in JOB_CASES])
def test_a_hostile_job_level_record_is_refused_naming_it(tmp_path, path, case, edit, error, match):
    _save(tmp_path)
    _edit_job(tmp_path / "step_00000007", edit)
    data, s = _loader(4 if path == "same_topology" else 3)
    model = nn.Linear(2, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with CheckpointManager(tmp_path, async_save=False) as mgr, pytest.raises(error, match=match):
        mgr.restore(model=model, dataloader=data)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "nothing was loaded"
    assert s.epoch == 0 and s._pending is None, "the sampler is unchanged"


def test_a_row_without_its_record_is_refused_by_the_loader_itself(tmp_path):
    """A row's part alone (a user loading a row into a loader by hand) names what is missing."""
    _save(tmp_path)
    _, rows = _rows(tmp_path / "step_00000007")
    data, _ = _loader(4)
    with pytest.raises(CheckpointError, match="without its job-level record"):
        data.load_state_dict(rows[0])
        next(iter(data))


# -- real ranks ----------------------------------------------------------------------------------
def _save_ranks(rank: int, ws: int, root: str) -> None:
    data, s = _loader(3, ws, rank)
    s.set_epoch(1)
    it = iter(data)
    for _ in range(2):
        next(it)
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(7, model=nn.Linear(2, 2), dataloader=data)


def _restore_ranks(rank: int, ws: int, root: str) -> None:
    data, s = _loader(2, ws, rank)
    with CheckpointManager(root, async_save=False) as mgr:
        assert mgr.restore(model=nn.Linear(2, 2), dataloader=data) == 7
        assert mgr.timeline[-1]["loader_states"] == (2 if rank == 0 else 0), "read once, on the coordinator"
    Path(root, f"rest{rank}.json").write_text(json.dumps([s.epoch, _ids(data)]))


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_two_ranks_save_one_record_and_three_ranks_resume_from_it(tmp_path):
    """Through CheckpointManager on gloo ranks: 2 ranks save 12 of 40 samples of epoch 1; the
    commit record holds the position once and the rows only counts; 3 ranks resume from it,
    continuing the one permutation from 12 (rank r: perm[12 + r :: 3])."""
    run_ranks(_save_ranks, 2, str(tmp_path), report_dir=tmp_path / "r1", timeout=180)
    meta, rows = _rows(tmp_path / "step_00000007")
    assert meta["dataloader"]["job_position"]["position"] == {"epoch": 1, "start": 0, "taken": []}
    parts = [ElasticSampler.find_state(r)[0] for r in rows]
    assert [(p["rank"], p["consumed"]) for p in parts] == [(0, 6), (1, 6)]
    assert all("position" not in p for p in parts), "no row holds the record"
    run_ranks(_restore_ranks, 3, str(tmp_path), report_dir=tmp_path / "r2", timeout=180)
    perm = epoch_order(N, seed=5, epoch=1, shuffle=True).tolist()
    for r in range(3):
        epoch, got = json.loads((tmp_path / f"rest{r}.json").read_text())
        assert epoch == 1 and got == perm[12 + r :: 3][: (N - 12) // 3], f"rank {r}"


# -- TokenStream: the shared part once per job, each reader's own counts in its row ----------------
def _shards(root: Path, sizes: list[int]) -> list[str]:
    root.mkdir()
    gid = 0
    for k, n in enumerate(sizes):  # sequences of 4 uint32 tokens, the first its id
        a = np.zeros((n, 4), dtype=np.uint32)
        a[:, 0] = np.arange(gid, gid + n)
        gid += n
        (root / f"s{k}.bin").write_bytes(a.tobytes())
    return [f"s{k}.bin" for k in range(len(sizes))]


def _stream(root: Path, names: list[str], workers: int) -> StatefulDataLoader:
    ts = TokenStream(str(root), names, seq_len=4, dtype="uint32", block=3)
    return StatefulDataLoader(ts, batch_size=2, num_workers=workers)


@pytest.mark.parametrize(("workers", "restore_workers"), [(2, 2), (2, 0)], ids=["same", "elastic"])
def test_a_token_stream_stores_its_shared_counts_once_per_job(tmp_path, workers, restore_workers):
    sizes = [7, 3, 12, 5, 9, 1, 6]
    names = _shards(tmp_path / "shards", sizes)
    data = _stream(tmp_path / "shards", names, workers)
    it = iter(data)
    seen = [int(x[0]) for _ in range(3) for x in next(it)]
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(7, model=nn.Linear(2, 2), dataloader=data)
    del it
    meta, rows = _rows(tmp_path / "run" / "step_00000007")
    job = meta["dataloader"]["job_position"]
    assert job["shards"] == names and job["base"] == [0] * 7 and job["sizes"] == [16 * n for n in sizes]
    parts = TokenStream.find_states(rows[0])
    assert len(parts) == workers and all(set(p) == {TS_MARK, "slot", "progress", "job"} for p in parts)
    fresh = _stream(tmp_path / "shards", names, restore_workers)
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        assert mgr.restore(model=nn.Linear(2, 2), dataloader=fresh) == 7
    rest = [int(x[0]) for b in fresh for x in b]
    assert sorted(seen + rest) == list(range(sum(sizes))), "no sequence twice, none skipped"


def test_a_token_streams_record_must_be_the_one_its_readers_were_split_from(tmp_path):
    names = _shards(tmp_path / "shards", [7, 3, 12])
    data = _stream(tmp_path / "shards", names, 0)
    it = iter(data)
    next(it)
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(7, model=nn.Linear(2, 2), dataloader=data)
    step = tmp_path / "run" / "step_00000007"
    for edit, error, match in (
        (_set_job("job_position.base", [1, 0, 0]), TopologyChangeError, "not split from the job's record"),
        (_set_job("job_position.base", [0, 0]), CorruptCheckpointError, "base must be 3 integers"),
        (_set_job("job_position.shards", ["a", "b", "c"]), CheckpointError, "differs from the saved one"),
        (lambda dl: dl.pop("job_position"), CorruptCheckpointError, "no job-level record"),
    ):
        good = (step / "manifest.json").read_bytes()
        _edit_job(step, edit)
        for workers in (0, 1):  # the same topology, and another worker count (elastic)
            with CheckpointManager(tmp_path / "run", async_save=False) as mgr, pytest.raises(error, match=match):
                mgr.restore(model=nn.Linear(2, 2), dataloader=_stream(tmp_path / "shards", names, workers))
        (step / "manifest.json").write_bytes(good)


def test_a_token_streams_saved_state_grows_with_shards_once_per_job_not_per_reader():
    """1,024 simulated ranks of 4 readers over 4,096 shards, each reader part way through its
    own shards: the commit record holds the names, base counts and sizes once; a row holds its
    readers' own counts. Unsplit, every reader carried every shard's counts (ranks x workers x
    shards: about 300 MB here)."""
    ranks, workers, shards = 1024, 4, 4096
    names = [f"shard-{k:05d}.bin" for k in range(shards)]
    stream = TokenStream("/nonexistent", names, seq_len=4, dtype="uint32", num_replicas=ranks, rank=0)
    base = {TS_MARK: 1, "shards": names, "seq_len": 4, "dtype": "uint32", "base": [0] * shards}
    rows, job = [], None
    for r in (0, 511, 1023):  # the split of three ranks' states, as a save makes it on each
        readers = [
            {**base, "slot": [r, w, ranks, workers], "progress": {str(r * workers + w): 5}, "sizes": [4096] * shards}
            for w in range(workers)
        ]
        row_state, j = TokenStream.split_job_state({"_snapshot": {"_worker_snapshots": readers}})
        job = job or j
        rows.append(row_state)
    record = len(json.dumps(job).encode())
    per_row = max(len(pickle.dumps(r, protocol=2)) for r in rows)
    print(f"token stream: job-level record {record} B ({record / shards:.1f} B a shard), a row's readers {per_row} B")
    assert record <= shards * (len(names[0]) + 4 + 2 + 8) + 200, "once: the names, base and sizes"
    assert per_row <= workers * 140, "a row holds its readers' own counts, no per-shard list"
    whole = len(pickle.dumps(readers, protocol=2))
    assert whole > 100 * per_row, "unsplit, a row carried every shard's counts"
    joined = [stream.join_job_state(r, json.loads(json.dumps(job))) for r in rows]
    assert all(
        p["base"] == [0] * shards and p["sizes"] == [4096] * shards for r in joined for p in stream.find_states(r)
    )


def test_a_token_stream_state_saved_whole_in_its_row_restores_as_before(tmp_path):
    """Rows written before the split hold every reader's whole state: joined, they are unchanged,
    and the elastic restore reads on from them."""
    names = _shards(tmp_path / "shards", [7, 3, 12])
    data = _stream(tmp_path / "shards", names, 2)
    it = iter(data)
    seen = [int(x[0]) for _ in range(3) for x in next(it)]
    whole = copy.deepcopy(data.state_dict())
    del it
    fresh = TokenStream(str(tmp_path / "shards"), names, seq_len=4, dtype="uint32", block=3)
    assert fresh.join_job_state(copy.deepcopy(whole), None) == whole
    fresh.elastic_resume([whole])
    rest = [int(x[0]) for x in fresh]
    assert sorted(seen + rest) == list(range(22))
