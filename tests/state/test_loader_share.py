"""An elastic restore reads the old ranks' loader states once, on the coordinator (issue 17).

Four real gloo ranks save an ``ElasticSampler`` loader to ``s3://`` on a moto server; then 4, 2
and 3 ranks restore it. Each rank counts the S3 ``GetObject`` requests it really sent whose byte
range covers a saved loader state (a botocore ``before-send`` hook on the boto3 session the
manager's store is built from), and reads its restore record's ``loader_states``. Expected:

- same topology (4 ranks): every rank reads its own state, once, and no other;
- elastic (2 and 3 ranks): the coordinator reads all 4, the other ranks none (they receive the
  bytes in one broadcast), and every rank takes up the position that decoding all 4 states
  locally gives (the single-process path), so no sample is read twice and none is skipped.

The restores that count GETs read with ``verify=False``: with verification a read grows to whole
hash chunks (8 MiB), so a rank that reads the model from old rank 0's file also fetches the bytes
of rank 0's loader state next to it. The 2-rank restore verifies and checks the record only.
With every rank reading every state (the behaviour before issue 17), the 3-rank GET count fails.

Also: ranks whose plans disagree on the sharing raise instead of hanging, and a two-tier restore
(node-local copies) shares the states the same way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.dist import run_ranks
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from goodput_ckpt import CheckpointManager, CheckpointReader
from goodput_ckpt.data import ElasticSampler
from goodput_ckpt.engine.manifest_load import load_manifest
from goodput_ckpt.format.dcp_metadata import torch_dtype
from goodput_ckpt.state import META_KEY
from goodput_ckpt.state.dataloader import decode_dataloader_row
from goodput_ckpt.storage import open_store

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

N = 64
OLD_WS = 4
STEP = 6


class Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def _loader(ws: int, rank: int, batch: int) -> tuple[StatefulDataLoader, ElasticSampler]:
    s = ElasticSampler(Ids(), seed=11, num_replicas=ws, rank=rank)
    return StatefulDataLoader(Ids(), batch_size=batch, sampler=s, num_workers=0), s


def _ids(batches) -> list[int]:
    return [i for b in batches for i in b.tolist()]


def _options(url: str, **extra) -> dict:
    return {"endpoint_url": url, "addressing_style": "path", "region": "us-east-1", **extra}


def _save(rank: int, ws: int, url: str, uri: str, out: str) -> None:
    loader, _ = _loader(ws, rank, batch=3)
    it = iter(loader)
    seen = _ids(next(it) for _ in range(rank + 1))  # unequal counts: the position is not trivial
    with CheckpointManager(uri, async_save=False, **_options(url)) as mgr:
        mgr.save(STEP, model=nn.Linear(3, 2), dataloader=loader)
    Path(out, f"seen{rank}.json").write_text(json.dumps(seen))


def _restore(rank: int, ws: int, url: str, uri: str, out: str, verify: bool) -> None:
    import boto3

    gets: list[tuple[str, str | None]] = []

    def count(request, **_kwargs) -> None:  # every GetObject this process sends
        gets.append((request.url, request.headers.get("Range")))

    session = boto3.session.Session()
    session.events.register("before-send.s3.GetObject", count)
    # The saved batch size under the same world size (a same-topology restore), another elsewhere.
    loader, _ = _loader(ws, rank, batch=3 if ws == OLD_WS else 2)
    with CheckpointManager(uri, async_save=False, verify=verify, **_options(url, session=session)) as mgr:
        assert mgr.restore(model=nn.Linear(3, 2), dataloader=loader) == STEP
        (record,) = [r for r in mgr.timeline if r["event"] == "restore"]
    got = [(u, r.decode() if isinstance(r, bytes) else r) for u, r in gets]
    rest = _ids(loader)
    result = {"gets": got, "loader_states": record.get("loader_states"), "rest": rest}
    Path(out, f"ws{ws}-rank{rank}.json").write_text(json.dumps(result))


def _blob_ranges(uri: str, url: str) -> dict[int, tuple[str, int, int]]:
    """Old rank -> (file, start, end) of its saved loader state, from the manifest."""
    manifest = load_manifest(open_store(uri, _options(url)))
    rows = manifest.items["dataloader.rows"]  # schema 2: a row per old rank
    assert rows.shape[0] == OLD_WS and len(rows.chunks) == OLD_WS
    return {chunk.offsets[0]: (chunk.file, chunk.offset, chunk.offset + chunk.length) for chunk in rows.chunks}


def _blobs_read(gets: list[tuple[str, str | None]], blobs: dict[int, tuple[str, int, int]]) -> list[int]:
    """The old ranks whose loader-state bytes these GETs fetched, once per GET that did."""
    read = []
    for url, rng in gets:
        if rng is None:
            lo, hi = 0, 1 << 62
        else:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng)
            assert m, rng
            lo, hi = int(m[1]), (int(m[2]) + 1 if m[2] else 1 << 62)
        for r, (file, start, end) in blobs.items():
            if url.endswith("/" + file) and lo < end and start < hi:
                read.append(r)
    return read


def _expected_positions(uri: str, url: str, ws: int) -> list[list[int]]:
    """What each new rank should read: all old states decoded here, in one process."""
    reader = CheckpointReader(uri, **_options(url))
    manifest = reader.manifest
    entry = manifest.items["dataloader.rows"]
    dest = {"dataloader": {"rows": torch.empty(entry.shape, dtype=torch_dtype(entry.dtype, entry.key))}}
    dcp.load(dest, storage_reader=reader, no_dist=True)
    out = []
    for rank in range(ws):
        states = [decode_dataloader_row(row, key=f"row {r}") for r, row in enumerate(dest["dataloader"]["rows"])]
        loader, s = _loader(ws, rank, batch=2)
        job = manifest.metadata[META_KEY]["dataloader"]["job_position"]  # the record, once per job
        states = [s.join_job_state(st, job) for st in states]
        s.elastic_resume(states, batch_size=2)
        loader.load_state_dict({})
        out.append(_ids(loader))
    return out


@pytest.mark.timeout(900)
def test_elastic_restore_reads_loader_states_once_on_the_coordinator(moto, tmp_path):
    uri = moto.uri("job")
    run_ranks(_save, OLD_WS, moto.url, uri, str(tmp_path), report_dir=tmp_path / "save", timeout=300)
    step_uri = f"{uri}/step_{STEP:08d}"
    blobs = _blob_ranges(step_uri, moto.url)
    assert len({f for f, _, _ in blobs.values()}) == OLD_WS, "each old rank's state in its own file"
    seen = [i for r in range(OLD_WS) for i in json.loads((tmp_path / f"seen{r}.json").read_text())]

    for ws, verify in ((OLD_WS, False), (3, False), (2, True)):
        run_ranks(_restore, ws, moto.url, uri, str(tmp_path), verify, report_dir=tmp_path / f"r{ws}", timeout=300)
        results = [json.loads((tmp_path / f"ws{ws}-rank{r}.json").read_text()) for r in range(ws)]
        records = [res["loader_states"] for res in results]
        if ws == OLD_WS:
            assert records == [1] * ws, "same topology: each rank its own state"
            for rank, res in enumerate(results):
                assert _blobs_read(res["gets"], blobs) == [rank], f"rank {rank} reads only its own state"
            continue
        if not verify:
            per_rank = [sorted(_blobs_read(res["gets"], blobs)) for res in results]
            assert per_rank == [list(range(OLD_WS))] + [[]] * (ws - 1), f"{ws} ranks: GETs of loader states {per_rank}"
        assert records == [OLD_WS] + [0] * (ws - 1), f"{ws} ranks: loader states read per rank {records}"
        rest = [res["rest"] for res in results]
        assert rest == _expected_positions(step_uri, moto.url, ws), "the position decoding every state gives"
        flat = seen + [i for r in rest for i in r]
        assert len(flat) == len(set(flat)), "no sample twice"
        assert N - len(flat) < 2 * ws, "none skipped but the tail that does not split into full batches"


def _save_two(rank: int, ws: int, root: str) -> None:
    loader, _ = _loader(ws, rank, batch=3)
    next(iter(loader))
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, model=nn.Linear(3, 2), dataloader=loader)


def _restore_disagreeing(rank: int, ws: int, root: str) -> None:
    from goodput_ckpt.errors import CheckpointError

    # Rank 0's loader changed its batch size (an elastic restore); rank 1's did not (its own
    # state). Rank 0 would broadcast the old states to a rank that never joins: refused instead.
    loader, _ = _loader(ws, rank, batch=2 if rank == 0 else 3)
    with CheckpointManager(root, async_save=False) as mgr:
        with pytest.raises(CheckpointError, match="disagree on the old ranks' loader states"):
            mgr.restore(model=nn.Linear(3, 2), dataloader=loader)


@pytest.mark.timeout(300)
def test_ranks_that_disagree_on_sharing_raise_instead_of_hanging(tmp_path):
    run_ranks(_save_two, 2, str(tmp_path), report_dir=tmp_path / "save", timeout=120)
    run_ranks(_restore_disagreeing, 2, str(tmp_path), report_dir=tmp_path / "restore", timeout=120)


def _save_tiers(rank: int, ws: int, root: str, local: str, out: str) -> None:
    loader, _ = _loader(ws, rank, batch=3)
    it = iter(loader)
    seen = _ids(next(it) for _ in range(rank + 1))
    with CheckpointManager(root, async_save=False, local_dir=local, local_world_size=1) as mgr:
        mgr.save(2, model=nn.Linear(3, 2), dataloader=loader)
    Path(out, f"tier-seen{rank}.json").write_text(json.dumps(seen))


def _restore_tiers(rank: int, ws: int, root: str, local: str, out: str) -> None:
    loader, _ = _loader(ws, rank, batch=2)  # another batch size: elastic at the same world size
    with CheckpointManager(root, async_save=False, local_dir=local, local_world_size=1) as mgr:
        assert mgr.restore(model=nn.Linear(3, 2), dataloader=loader) == 2
        (record,) = [r for r in mgr.timeline if r["event"] == "restore"]
    Path(out, f"tier-rest{rank}.json").write_text(
        json.dumps({"loader_states": record["loader_states"], "rest": _ids(loader)})
    )


@pytest.mark.timeout(300)
def test_two_tier_elastic_restore_shares_too(tmp_path):
    """With node-local tiers (each rank its own simulated node) the coordinator reads both old
    states from its node's copy and the other rank receives them."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local" / "node{node}")
    run_ranks(_save_tiers, 2, root, local, str(tmp_path), report_dir=tmp_path / "save", timeout=120)
    run_ranks(_restore_tiers, 2, root, local, str(tmp_path), report_dir=tmp_path / "restore", timeout=120)
    results = [json.loads((tmp_path / f"tier-rest{r}.json").read_text()) for r in range(2)]
    assert [r["loader_states"] for r in results] == [2, 0]
    seen = [i for r in range(2) for i in json.loads((tmp_path / f"tier-seen{r}.json").read_text())]
    flat = seen + [i for r in results for i in r["rest"]]
    assert len(flat) == len(set(flat)) and N - len(flat) < 4, "every pending sample once"
