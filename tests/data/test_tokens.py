"""TokenStream: fixed-length token sequences over shard files, resumable and reshardable.

Every sequence's first token is its global id, so a test can tell which sequences were read.
Ranks are simulated in one process (``num_replicas``/``rank`` given)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from goodput_ckpt import CheckpointManager
from goodput_ckpt.data import TokenStream

SEQ = 8
LENGTHS = [5, 17, 0, 9, 23, 4, 11]  # sequences per shard (one empty)


def _shards(root, dtype="uint16") -> tuple[list[str], int]:
    names, gid = [], 0
    for k, n in enumerate(LENGTHS):
        a = np.arange(n * SEQ, dtype=np.int64).reshape(n, SEQ) % 1000 + 1000
        a[:, 0] = np.arange(gid, gid + n)
        gid += n
        name = f"shard{k:03d}.bin"
        raw = a.astype(dtype).tobytes() + b"\x01\x02\x03"  # a trailing partial sequence is not read
        (root / name).write_bytes(raw)
        names.append(name)
    return names, gid


def _ids(batches) -> list[int]:
    return [int(b[0]) for batch in batches for b in batch]


def _stream(root, names, ws=1, rank=0, dtype="uint16"):
    return TokenStream(str(root), names, seq_len=SEQ, dtype=dtype, block=4, num_replicas=ws, rank=rank)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_one_pass_reads_every_sequence_once(tmp_path, dtype):
    names, total = _shards(tmp_path, dtype)
    ds = _stream(tmp_path, names, dtype=dtype)
    seqs = list(ds)
    assert sorted(int(s[0]) for s in seqs) == list(range(total))
    assert all(s.shape == (SEQ,) and s.dtype == getattr(torch, dtype) for s in seqs)
    assert ds.lengths() == LENGTHS


def _run(loaders, steps):
    ids, its = [], [iter(ld) for ld in loaders]
    for _ in range(steps):
        for it in its:
            b = next(it, None)
            if b is not None:
                ids += _ids([b])
    return ids, [ld.state_dict() for ld in loaders]


def test_same_topology_resume_with_workers(tmp_path):
    names, total = _shards(tmp_path)
    ld = StatefulDataLoader(_stream(tmp_path, names), batch_size=3, num_workers=2)
    it = iter(ld)
    seen = _ids(next(it) for _ in range(4))
    state = ld.state_dict()
    rest = _ids(it)
    again = StatefulDataLoader(_stream(tmp_path, names), batch_size=3, num_workers=2)
    again.load_state_dict(state)
    assert _ids(again) == rest
    assert sorted(seen + rest) == list(range(total))


def test_restarts_at_other_world_sizes_and_worker_counts(tmp_path):
    names, total = _shards(tmp_path)
    seen: list[int] = []
    states = None
    for ws, workers, steps in ((2, 2, 3), (3, 0, 2), (1, 2, 4), (2, 0, 1000)):
        loaders = []
        for r in range(ws):
            ds = _stream(tmp_path, names, ws, r)
            if states is not None:
                assert "unfinished shard" in ds.elastic_resume(states)
            loaders.append(StatefulDataLoader(ds, batch_size=2, num_workers=workers))
        ids, states = _run(loaders, steps)
        seen += ids
    assert len(seen) == len(set(seen)), "no sequence twice"
    assert sorted(seen) == list(range(total)), "none skipped"


def test_manager_restores_it_under_another_worker_count(tmp_path):
    names, total = _shards(tmp_path)
    model = torch.nn.Linear(2, 2)
    ld = StatefulDataLoader(_stream(tmp_path, names), batch_size=3, num_workers=2)
    it = iter(ld)
    seen = _ids(next(it) for _ in range(5))
    mgr = CheckpointManager(tmp_path / "run", async_save=False)
    mgr.save(1, model=model, dataloader=ld)
    fresh = StatefulDataLoader(_stream(tmp_path, names), batch_size=2, num_workers=0)
    assert mgr.restore(model=model, dataloader=fresh) == 1  # no flag
    mgr.close()
    rest = _ids(fresh)
    assert sorted(seen + rest) == list(range(total))


def test_saved_counts_are_checked_before_they_index_shards(tmp_path):
    """Counts read from a checkpoint: a negative shard index used to move the last shard's
    position silently (Python's negative indexing), an extra base count raised IndexError."""
    from goodput_ckpt.errors import CheckpointError

    names, _ = _shards(tmp_path, "uint16")
    state = _stream(tmp_path, names).state_dict()
    for bad in ({"progress": {"-1": 2}}, {"base": state["base"] + [0]}, {"progress": {"0": -5}}):
        with pytest.raises(CheckpointError, match="counts do not fit"):
            _stream(tmp_path, names).load_state_dict({**state, **bad})
        with pytest.raises(CheckpointError, match="counts do not fit"):
            _stream(tmp_path, names).elastic_resume([{**state, **bad}])
