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


# -- batched mode, cross-shard read-ahead, buffer reuse ---------------------------------------


def _rows_of(root, names, dtype="uint16") -> dict[int, np.ndarray]:
    """Every sequence in the files, by its id (its first token): what a yielded row must hold."""
    rows = {}
    for name in names:
        raw = (root / name).read_bytes()
        a = np.frombuffer(raw[: len(raw) // (SEQ * np.dtype(dtype).itemsize) * SEQ * np.dtype(dtype).itemsize], dtype)
        for r in a.reshape(-1, SEQ):
            rows[int(r[0])] = r.copy()
    return rows


def _check_rows(batches, expect) -> list[int]:
    """The ids of ``batches`` ((B, SEQ) or (SEQ,) tensors), each row checked against the files."""
    ids = []
    for b in batches:
        for r in b.reshape(-1, SEQ):
            ids.append(int(r[0]))
            assert np.array_equal(r.numpy(), expect[ids[-1]]), f"sequence {ids[-1]} holds other data"
    return ids


@pytest.mark.parametrize(
    "batch,block,ahead", [(4, None, 2), (3, 4, 2), (5, 2, 0), (1, 7, 2), (3, 4, None), (2, 4, 0), (3, 6, None)]
)
def test_batched_pass_reads_every_sequence_once_and_keeps_kept_batches(tmp_path, batch, block, ahead):
    """Every batch is kept (list) while the stream goes on reusing buffers: none may change.
    Blocks not a multiple of the batch and shard ends make batches that span blocks/shards."""
    names, total = _shards(tmp_path)
    expect = _rows_of(tmp_path, names)
    ds = TokenStream(str(tmp_path), names, seq_len=SEQ, batch_size=batch, block=block, read_ahead=ahead)
    batches = list(ds)
    assert all(b.shape == (batch, SEQ) for b in batches[:-1]) and 1 <= len(batches[-1]) <= batch
    assert sorted(_check_rows(batches, expect)) == list(range(total))


def test_sequences_are_not_overwritten_while_held(tmp_path):
    """Per-sequence mode over reused buffers: views held by the caller keep their data."""
    names, total = _shards(tmp_path)
    expect = _rows_of(tmp_path, names)
    for ahead in (0, 1):
        held = list(TokenStream(str(tmp_path), names, seq_len=SEQ, block=2, read_ahead=ahead))
        assert sorted(_check_rows(held, expect)) == list(range(total))


def test_read_ahead_into_the_next_shard_is_not_counted(tmp_path):
    """With read_ahead spanning several shards, the state counts only what was yielded: a
    restore elsewhere reads the rest of the current shard and the shards read ahead in full."""
    names, total = _shards(tmp_path)
    ds = TokenStream(str(tmp_path), names, seq_len=SEQ, batch_size=2, block=2, read_ahead=16)
    it = iter(ds)
    seen = _ids([next(it) for _ in range(3)])  # 6 sequences: all of shard 0 (5) and one of shard 1
    state = ds.state_dict()
    it.close()
    assert state["progress"] == {"0": 5, "1": 1}, "shards only read ahead are not counted"
    assert sorted(seen) == list(range(6))
    rest = []
    for r in range(3):
        again = TokenStream(str(tmp_path), names, seq_len=SEQ, batch_size=4, num_replicas=3, rank=r)
        again.elastic_resume([state])
        rest += _ids(again)
    assert sorted(seen + rest) == list(range(total))


def test_batched_same_topology_resume_with_workers(tmp_path):
    """batch_size=N on the stream, batch_size=None on the loader: workers send views of the
    blocks to the main process (shared memory); a restore continues exactly."""
    names, total = _shards(tmp_path)
    expect = _rows_of(tmp_path, names)

    def loader():
        ds = TokenStream(str(tmp_path), names, seq_len=SEQ, batch_size=3, block=6, read_ahead=2)
        return StatefulDataLoader(ds, batch_size=None, num_workers=2)

    ld = loader()
    it = iter(ld)
    first = [next(it) for _ in range(5)]
    state = ld.state_dict()
    rest = list(it)
    again = loader()
    again.load_state_dict(state)
    resumed = list(again)
    assert _ids(resumed) == _ids(rest)
    assert sorted(_check_rows(first + resumed, expect)) == list(range(total))


def test_batched_restarts_at_other_world_sizes_worker_counts_and_batch_sizes(tmp_path):
    names, total = _shards(tmp_path)
    expect = _rows_of(tmp_path, names)
    seen: list[int] = []
    states = None
    for ws, workers, batch, steps in ((2, 2, 3, 3), (3, 0, 2, 2), (1, 2, 5, 2), (2, 0, 4, 1000)):
        loaders = []
        for r in range(ws):
            ds = TokenStream(
                str(tmp_path), names, seq_len=SEQ, batch_size=batch, block=4, read_ahead=3, num_replicas=ws, rank=r
            )
            if states is not None:
                ds.elastic_resume(states)
            loaders.append(StatefulDataLoader(ds, batch_size=None, num_workers=workers))
        its = [iter(ld) for ld in loaders]
        for _ in range(steps):
            for it in its:
                b = next(it, None)
                if b is not None:
                    seen += _check_rows([b], expect)
        states = [ld.state_dict() for ld in loaders]
    assert len(seen) == len(set(seen)), "no sequence twice"
    assert sorted(seen) == list(range(total)), "none skipped"


def test_batched_stream_from_s3_resumes_elastically(tmp_path, moto):
    """Shards on a real S3 server (moto on 127.0.0.1): batched, read ahead across shards, saved
    mid-way by one rank and finished by two."""
    names, total = _shards(tmp_path)
    client = moto.client()
    for name in names:
        client.upload_file(str(tmp_path / name), moto.bucket, f"tok/{name}")
    root, opts = moto.uri("tok"), moto.options()
    ds = TokenStream(root, names, seq_len=SEQ, batch_size=4, block=4, read_ahead=4, storage_options=opts)
    it = iter(ds)
    seen = _ids([next(it) for _ in range(6)])
    state = ds.state_dict()
    it.close()
    for r in range(2):
        again = TokenStream(root, names, seq_len=SEQ, batch_size=3, storage_options=opts, num_replicas=2, rank=r)
        again.elastic_resume([state])
        seen += _ids(again)
    assert len(seen) == len(set(seen)) and sorted(seen) == list(range(total))


def test_batch_size_is_checked(tmp_path):
    names, _ = _shards(tmp_path)
    with pytest.raises(ValueError, match="batch_size"):
        TokenStream(str(tmp_path), names, seq_len=SEQ, batch_size=0)


@pytest.mark.parametrize("batch", [None, 3])
def test_the_state_counts_exactly_what_was_yielded_after_every_item(tmp_path, batch):
    """The count of the block being yielded from is taken from its iterator when the state is
    asked for: after every item it holds, per shard, exactly the sequences yielded so far (a
    batch that spans shards counts in each)."""
    names, total = _shards(tmp_path)
    ds = TokenStream(str(tmp_path), names, seq_len=SEQ, batch_size=batch, block=4, read_ahead=0)
    starts = np.cumsum([0, *LENGTHS])
    seen: dict[str, int] = {}
    for item in ds:
        for gid in (int(item[0]),) if batch is None else (int(r[0]) for r in item):
            shard = int(np.searchsorted(starts, gid, side="right")) - 1
            seen[str(shard)] = seen.get(str(shard), 0) + 1
        assert ds.state_dict()["progress"] == seen
    assert sum(seen.values()) == total


def test_a_stream_pickled_mid_block_carries_its_count_not_its_views(tmp_path):
    import pickle

    names, _ = _shards(tmp_path)
    ds = TokenStream(str(tmp_path), names, seq_len=SEQ, block=4, read_ahead=0)
    it = iter(ds)
    for _ in range(7):  # shard 0 (5 sequences) and 2 of shard 1, mid-block
        next(it)
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._live is None
    assert copy.state_dict()["progress"] == ds.state_dict()["progress"] == {"0": 5, "1": 2}
    it.close()
    assert ds.state_dict()["progress"] == {"0": 5, "1": 2}, "closing mid-block keeps the count"


def test_a_remote_stream_fetches_several_blocks_per_request(tmp_path, moto, monkeypatch):
    """On S3 (moto on 127.0.0.1) each GET fetches up to ``blocks_per_request`` consecutive blocks
    of a shard (default 4: each request costs the client CPU), and every sequence still comes
    once, in order within its shard."""
    from goodput_ckpt.data import tokens
    from goodput_ckpt.storage import _s3_download

    names, total = _shards(tmp_path)
    client = moto.client()
    for name in names:
        client.upload_file(str(tmp_path / name), moto.bucket, f"tok/{name}")
    reads: list[int] = []
    read_into = _s3_download.S3Source.read_into

    def counted(self, offset, buffers):
        reads.append(len(buffers))
        return read_into(self, offset, buffers)

    monkeypatch.setattr(_s3_download.S3Source, "read_into", counted)
    for per_request, want in ((None, tokens._BLOCKS_PER_REQUEST), (2, 2), (1, 1)):
        reads.clear()
        ds = TokenStream(
            moto.uri("tok"), names, seq_len=SEQ, block=2, blocks_per_request=per_request, storage_options=moto.options()
        )
        ids = [int(s[0]) for s in ds]
        assert ids == list(range(total)), "one rank reads its shards in order"
        blocks = [-(-n // 2) for n in LENGTHS]
        assert sorted(reads) == sorted(min(want, b - g) for b in blocks for g in range(0, b, want)), (
            f"blocks_per_request={per_request}: one GET per {want} blocks of a shard"
        )


def test_blocks_per_request_is_checked(tmp_path):
    names, _ = _shards(tmp_path)
    with pytest.raises(ValueError, match="blocks_per_request"):
        TokenStream(str(tmp_path), names, seq_len=SEQ, blocks_per_request=0)


def test_a_stream_on_a_mounted_volume_reads_every_sequence_once_and_resumes(tmp_path, volume_dir):
    """Shards on a real FUSE mount (rclone over S3: no seek on write; weed mount), read with the
    remote defaults (blocks read ahead, several blocks per read), saved mid-way by one rank and
    finished by three."""
    from goodput_ckpt.storage import open_store

    names, total = _shards(tmp_path)
    volume_dir.mkdir()
    for name in names:
        with open(volume_dir / name, "wb") as f:  # sequential writes only
            f.write((tmp_path / name).read_bytes())
    assert open_store(str(volume_dir), {}).traits.kind == "volume", "the remote defaults apply"
    ds = TokenStream(str(volume_dir), names, seq_len=SEQ, block=2, batch_size=2)
    it = iter(ds)
    seen = _ids([next(it) for _ in range(7)])
    state = ds.state_dict()
    it.close()
    for r in range(3):
        again = TokenStream(str(volume_dir), names, seq_len=SEQ, block=3, num_replicas=3, rank=r)
        again.elastic_resume([state])
        seen += [int(s[0]) for s in again]
    assert len(seen) == len(set(seen)) and sorted(seen) == list(range(total))
