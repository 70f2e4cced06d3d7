"""Restoring an ElasticSampler loader through CheckpointManager: same topology bit-exact, another
worker count, batch size or world size elastic (no flag), and checkpoints without loader state."""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.dist import run_ranks  # noqa: E402
from helpers.logs import logged_warnings  # noqa: E402
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from goodput_ckpt import CheckpointManager
from goodput_ckpt.data import ElasticSampler, TokenStream
from goodput_ckpt.engine.manifest_load import load_manifest
from goodput_ckpt.errors import CorruptCheckpointError, TopologyChangeError
from goodput_ckpt.format.schema import MAX_WORLD_SIZE
from goodput_ckpt.state import META_KEY, Topology, normalize, plan_restore
from goodput_ckpt.state.rng import derived_seed
from goodput_ckpt.storage import open_store
from goodput_ckpt.tools.ops.reshard import reshard_checkpoint

N = 40


class Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def _loader(workers: int, batch: int, ws: int = 1, rank: int = 0):
    s = ElasticSampler(Ids(), seed=5, num_replicas=ws, rank=rank)
    return StatefulDataLoader(Ids(), batch_size=batch, sampler=s, num_workers=workers), s


def _ids(batches) -> list[int]:
    return [i for b in batches for i in b.tolist()]


def test_same_topology_is_bit_exact(tmp_path):
    model = nn.Linear(2, 2)
    loader, s = _loader(2, 4)
    s.set_epoch(3)
    it = iter(loader)
    for _ in range(3):
        next(it)
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, model=model, dataloader=loader)
    want = _ids(it)
    fresh, fs = _loader(2, 4)
    assert mgr.restore(model=model, dataloader=fresh) == 1
    assert fs.epoch == 3, "the restored epoch is known right after restore"
    assert _ids(fresh) == want
    assert mgr.timeline[-1]["loader_states"] == 1, "its own loader state, read once"
    mgr.close()


def test_the_old_rank_count_is_bounded_before_it_sizes_anything(tmp_path):
    """A hostile ``dataloader.ranks`` must not allocate a template per claimed rank."""
    model = nn.Linear(2, 2)
    loader, _ = _loader(0, 4)
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, model=model, dataloader=loader)
    manifest = load_manifest(open_store(str(tmp_path / "step_00000001"), {}))
    meta = manifest.metadata[META_KEY]
    for ranks in (MAX_WORLD_SIZE + 1, 1 << 40, 0, True):
        bad = dataclasses.replace(
            manifest,
            metadata={**manifest.metadata, META_KEY: {**meta, "dataloader": {**meta["dataloader"], "ranks": ranks}}},
        )
        with pytest.raises(CorruptCheckpointError, match="dataloader ranks"):
            plan_restore(
                bad,
                where="x",
                models=normalize(model, None),
                dataloader=_loader(0, 4, 2, 0)[0],
                stateful={},
                topology=Topology(rank=0, world_size=2),
                allow_topology_change=False,
            )


@pytest.mark.parametrize(("before", "after"), [((2, 4), (0, 3)), ((0, 4), (2, 5))])
def test_other_worker_count_and_batch_size_need_no_flag(tmp_path, caplog, before, after):
    model = nn.Linear(2, 2)
    loader, s = _loader(*before)
    it = iter(loader)
    seen = _ids(next(it) for _ in range(3))
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, model=model, dataloader=loader)
    fresh, fs = _loader(*after)
    with caplog.at_level(logging.INFO, logger="goodput_ckpt"):
        assert mgr.restore(model=model, dataloader=fresh) == 1
    assert "taken up elastically" in caplog.text
    rest = _ids(fresh)
    assert sorted(seen + rest) == list(range(N)), "every sample once"
    mgr.close()


def test_other_loaders_keep_the_topology_check(tmp_path):
    model = nn.Linear(2, 2)
    loader = StatefulDataLoader(Ids(), batch_size=4, shuffle=True, num_workers=0)
    next(iter(loader))
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, model=model, dataloader=loader)
    with pytest.raises(TopologyChangeError, match="num_workers 0 -> 2"):
        mgr.restore(model=model, dataloader=_loader(2, 4)[0])  # elastic now, but not when saved
    mgr.close()


def test_checkpoint_without_loader_state_restores_with_a_loader(tmp_path):
    """Issue 20 item 2: the standard loop passes dataloader= to a checkpoint that has none."""
    model = nn.Linear(2, 2)
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, model=model)
    loader, _ = _loader(0, 4)
    with logged_warnings("starts from its beginning"):
        assert mgr.restore(model=model, dataloader=loader) == 1
    assert len(_ids(loader)) == N
    mgr.close()


def _save_two(rank: int, ws: int, root: str) -> None:
    torch.manual_seed(77)
    loader, s = _loader(0, 3, ws, rank)
    it = iter(loader)
    seen = _ids(next(it) for _ in range(2))
    mgr = CheckpointManager(root, async_save=False)
    mgr.save(4, model=nn.Linear(2, 2), dataloader=loader)
    mgr.close()
    torch.save(seen, Path(root, f"seen{rank}.pt"))
    # The token stream, with 2 workers per rank, saved under its own root.
    tokens = StatefulDataLoader(_tokens(root, ws, rank), batch_size=2, num_workers=2)
    it = iter(tokens)
    seen = [int(x[0]) for _ in range(3) for x in next(it)]
    mgr = CheckpointManager(Path(root, "tok"), async_save=False)
    mgr.save(2, model=nn.Linear(2, 2), dataloader=tokens)
    mgr.close()
    torch.save(seen, Path(root, f"tok-seen{rank}.pt"))


def _tokens(root: str, ws: int, rank: int) -> TokenStream:
    names = sorted(p.name for p in Path(root, "shards").iterdir())
    return TokenStream(str(Path(root, "shards")), names, seq_len=4, dtype="uint32", block=3, num_replicas=ws, rank=rank)


def _restore_three(rank: int, ws: int, root: str, resharded: str) -> None:
    loader, s = _loader(0, 2, ws, rank)
    mgr = CheckpointManager(resharded, async_save=False)  # reshard --world-size 3 --rank-state drop
    assert mgr.restore(model=nn.Linear(2, 2), dataloader=loader) == 4
    mgr.close()
    torch.save(_ids(loader), Path(root, f"resharded{rank}.pt"))

    loader, s = _loader(2, 2, ws, rank)
    mgr = CheckpointManager(root, async_save=False)
    assert mgr.restore(model=nn.Linear(2, 2), dataloader=loader) == 4
    mgr.close()
    seed = derived_seed(77, 4, rank)
    rng = (torch.get_rng_state(), random.random())
    torch.manual_seed(seed)
    random.seed(seed)
    assert torch.equal(rng[0], torch.get_rng_state()) and rng[1] == random.random(), "RNG re-derived"
    torch.save(_ids(loader), Path(root, f"rest{rank}.pt"))

    tokens = StatefulDataLoader(_tokens(root, ws, rank), batch_size=3, num_workers=0)
    mgr = CheckpointManager(Path(root, "tok"), async_save=False)
    assert mgr.restore(model=nn.Linear(2, 2), dataloader=tokens) == 2
    mgr.close()
    torch.save([int(x[0]) for b in tokens for x in b], Path(root, f"tok-rest{rank}.pt"))


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ranks_to_three(tmp_path):
    """ElasticSampler and TokenStream loaders saved by 2 ranks, restored by 3; the sampler's
    checkpoint also after ``reshard --world-size 3 --rank-state drop``."""
    (tmp_path / "shards").mkdir()
    gid = 0
    for k, n in enumerate([7, 3, 12, 5, 9, 1, 6]):  # sequences of 4 uint32 tokens, the first its id
        a = np.zeros((n, 4), dtype=np.uint32)
        a[:, 0] = np.arange(gid, gid + n)
        gid += n
        (tmp_path / "shards" / f"s{k}.bin").write_bytes(a.tobytes())
    run_ranks(_save_two, 2, str(tmp_path), report_dir=tmp_path / "r1", timeout=180)
    src = tmp_path / "step_00000004"
    reshard_checkpoint(str(src), str(tmp_path / "resharded" / src.name), world_size=3, rank_state="drop")
    run_ranks(_restore_three, 3, str(tmp_path), str(tmp_path / "resharded"), report_dir=tmp_path / "r2", timeout=180)
    seen = [i for r in range(2) for i in torch.load(tmp_path / f"seen{r}.pt")]
    rest = [i for r in range(3) for i in torch.load(tmp_path / f"rest{r}.pt")]
    assert len(seen) == 12 and len(seen + rest) == len(set(seen + rest)), "no sample twice"
    assert N - len(seen + rest) < 3, "only the tail that does not split over 3 ranks"
    for r in range(3):
        assert torch.load(tmp_path / f"resharded{r}.pt") == torch.load(tmp_path / f"rest{r}.pt"), "reshard kept it"
    tok = [i for r in range(2) for i in torch.load(tmp_path / f"tok-seen{r}.pt")]
    tok += [i for r in range(3) for i in torch.load(tmp_path / f"tok-rest{r}.pt")]
    assert sorted(tok) == list(range(gid)), "token stream: no sequence twice, none skipped"
