"""Hostile saved loader states (issue 33): every count, position, bitmap and shard count a
checkpoint holds is an exact type in its real range before it is used, refused by name
(the old rank's row and the field) in bounded work: counted calls (``helpers.budget``), torch
elements produced, Python memory; never wall-clock time.

The same states through ``CheckpointManager.restore``, with the live objects left unchanged,
are tests/state/test_restore_hostile.py.
"""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from helpers.budget import TorchWork, counted_calls, python_peak
from helpers.datasets import Ids as _Ids
from helpers.hostile_states import cyclic as _cyclic
from helpers.hostile_states import deflated as _deflated
from helpers.hostile_states import saved as _saved
from torchdata.stateful_dataloader import StatefulDataLoader

from goodput_ckpt.data import ElasticSampler, EpochPosition, TokenStream
from goodput_ckpt.engine.untrusted_load import MAX_INFLATION, MAX_STATE_DEPTH, walk_state
from goodput_ckpt.errors import CheckpointError, CorruptCheckpointError
from goodput_ckpt.state.dataloader import ROW_HEADER, decode_dataloader_row
from goodput_ckpt.state.per_rank import checked_rng
from goodput_ckpt.state.rng import capture_rng, check_layout, restore_rng, rng_layout

N, BATCH = 56, 4


def Ids() -> _Ids:  # noqa: N802 - the dataset of N samples these tests use
    return _Ids(N)


def _sampler(ws: int, rank: int) -> ElasticSampler:
    return ElasticSampler(Ids(), seed=3, num_replicas=ws, rank=rank)


def _states(steps: int = 3) -> list[dict]:
    """Two old ranks' loader states after ``steps`` batches each, through a weights_only
    round trip (what a restore decodes)."""
    out = []
    for r in range(2):
        ld = StatefulDataLoader(Ids(), batch_size=BATCH, sampler=_sampler(2, r), num_workers=0)
        it = iter(ld)
        for _ in range(steps):
            next(it)
        out.append(_roundtrip(ld.state_dict()))
    return out


def _roundtrip(value):
    buf = io.BytesIO()
    torch.save(value, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def _sampler_state(ls: dict) -> dict:
    st, _ = ElasticSampler.find_state(ls)
    return st


def _set(path: str, value):
    """A mutation of one old rank's loader state: ``path`` is a field of the sampler state
    (``consumed``), of its position (``position.epoch``) or of the loader (``/_steps_since_snapshot``)."""

    def apply(ls: dict) -> None:
        if path.startswith("/"):
            ls[path[1:]] = value
            return
        target = _sampler_state(ls)
        *parents, last = path.split(".")
        for p in parents:
            target = target[p]
        target[last] = value

    return apply


def _v1(segments=(), done=None):
    """A mutation making one old rank's sampler state a version-1 one (a segment history), as an
    older goodput-ckpt wrote it: still read, through the same checks."""

    def apply(ls: dict) -> None:
        st = _sampler_state(ls)
        st["goodput_elastic_sampler"] = 1  # the sampler state's version mark
        st["position"] = {"epoch": st["position"]["epoch"], "segments": list(segments), "done": done}

    return apply


#: (case, mutation, the field the refusal names). Each was accepted, or escaped as a raw error.
COUNTS = [
    ("consumed_minus_1", _set("consumed", -1), "consumed"),  # 1 sample left of 56
    ("consumed_minus_50", _set("consumed", -50), "consumed"),
    ("consumed_huge", _set("consumed", 10**6), "consumed"),  # clamped silently to 0 left
    ("consumed_inf", _set("consumed", float("inf")), "consumed"),  # OverflowError
    ("consumed_float", _set("consumed", 5.5), "consumed"),
    ("consumed_bool", _set("consumed", True), "consumed"),
    ("consumed_str", _set("consumed", "7"), "consumed"),
    ("since_minus_12", _set("/_steps_since_snapshot", -12), "_steps_since_snapshot"),
    ("since_inf", _set("/_steps_since_snapshot", float("inf")), "_steps_since_snapshot"),
    ("since_past_share", _set("/_steps_since_snapshot", 10), "_steps_since_snapshot"),
    ("world_size_zero", _set("world_size", 0), "world_size"),
    ("rank_negative", _set("rank", -1), "rank"),
    ("rank_past_world", _set("rank", 2), "rank"),
    ("epoch_2_70", _set("position.epoch", 2**70), "epoch"),  # failed later, in manual_seed
    ("epoch_inf", _set("position.epoch", float("inf")), "epoch"),
    ("epoch_negative", _set("position.epoch", -1), "epoch"),
    ("start_negative", _set("position.start", -1), "start"),
    ("start_past_epoch", _set("position.start", N + 1), "start"),
    ("start_inf", _set("position.start", float("inf")), "start"),
    ("start_float", _set("position.start", 3.0), "start"),
    ("taken_a_million", _set("position.taken", list(range(1, 10**6))), "taken must be a list of at most"),
    ("taken_a_dict", _set("position.taken", {"1": 1}), "taken must be a list"),
    ("taken_before_start", _set("position.taken", [0]), r"taken\[0\]"),
    ("taken_past_epoch", _set("position.taken", [N]), r"taken\[0\]"),
    ("taken_unsorted", _set("position.taken", [9, 5]), r"taken\[1\]"),
    ("taken_twice", _set("position.taken", [5, 5]), r"taken\[1\]"),
    ("taken_bool", _set("position.taken", [True]), r"taken\[0\]"),
    ("segment_world_inf", _v1([[float("inf"), [1]]]), "world size"),
    ("segment_count_negative", _v1([[2, [3, -4]]]), "count of rank 1"),
    ("segment_count_past_share", _v1([[2, [3, 40]]]), "consumed 40 samples"),
]


@pytest.mark.parametrize(("case", "mutate", "field"), COUNTS, ids=[c[0] for c in COUNTS])
def test_elastic_resume_refuses_each_count_out_of_its_range_by_row_and_field(case, mutate, field):
    states = _states()
    # A position every old rank shares is edited in all of them (else they disagree): the first names it.
    bad = [0, 1] if case.startswith(("epoch", "segment", "start", "taken")) else [1]
    for r in bad:
        mutate(states[r])
    sampler = _sampler(3, 0)
    with pytest.raises(CorruptCheckpointError, match=rf"old rank {bad[0]}.*{field}"):
        sampler.elastic_resume(states, batch_size=BATCH, where="ckpt")
    assert sampler._pending is None and sampler.epoch == 0, "nothing applied"


@pytest.mark.parametrize(("case", "mutate", "field"), COUNTS, ids=[c[0] for c in COUNTS])
def test_the_same_topology_path_runs_the_same_validation(case, mutate, field):
    """One home: the check a same-topology restore runs before it applies the state (and the
    iterator's own ``load_state_dict``) refuses what the elastic path refuses."""
    states = _states()
    mutate(states[1])
    sampler = _sampler(2, 1)
    if not case.startswith("since"):  # the loader applies its own steps since the snapshot
        with pytest.raises(CheckpointError, match=field):
            iter(sampler).load_state_dict(_sampler_state(states[1]))
    with pytest.raises(CheckpointError, match=field):
        sampler.check_saved_state(states[1], batch_size=BATCH, where="ckpt")


def test_valid_states_pass_both_paths():
    states = _states()
    _sampler(2, 1).check_saved_state(states[1], batch_size=BATCH)
    note = _sampler(3, 0).prepare_elastic_resume(states, batch_size=BATCH)()
    assert "24 sample(s) consumed" in note


def test_steps_since_the_snapshot_without_a_batch_size_are_not_refused():
    """A loader with a ``batch_sampler`` records no batch size: the loader fast-forwards its own
    steps under the same topology, so its state is not refused for them."""
    states = _states()
    states[1]["_steps_since_snapshot"] = 2
    _sampler(2, 1).check_saved_state(states[1], batch_size=None)
    _sampler(3, 0).prepare_elastic_resume(states, batch_size=None)


@pytest.mark.parametrize("batch_size", [-1, 0, 2.5, "4", True])
def test_the_metadata_batch_size_must_be_a_positive_integer(batch_size):
    states = _states()
    with pytest.raises(CorruptCheckpointError, match="batch_size"):
        _sampler(3, 0).elastic_resume(states, batch_size=batch_size, where="ckpt")


def test_a_string_batch_size_is_refused_before_it_multiplies_memory():
    """``"xxxxxxxx" * since`` built a 1 GiB string before failing; the type is checked first."""
    states = _states()
    since = 1 << 20  # 8 MiB of string before the fix
    for ls in states:
        ls["_steps_since_snapshot"] = since
    sampler = _sampler(3, 0)
    _, peak, err = python_peak(lambda: sampler.elastic_resume(states, batch_size="xxxxxxxx", where="ckpt"))
    assert isinstance(err, CorruptCheckpointError), err
    assert peak < 1 << 20, f"{peak} bytes of Python memory"


# -- the bounded walk ---------------------------------------------------------------------------


def test_a_self_containing_state_is_refused_by_name_in_bounded_work():
    states = _states()
    states[1]["dataset_state"] = _roundtrip(_cyclic())  # weights_only takes it
    assert states[1]["dataset_state"][2] is states[1]["dataset_state"]
    sampler = _sampler(3, 0)
    with pytest.raises(CorruptCheckpointError, match=r"old rank 1.*contains itself"):
        counted_calls(lambda: sampler.elastic_resume(states, batch_size=BATCH, where="ckpt"), 200_000)
    with pytest.raises(CorruptCheckpointError, match="contains itself"):
        counted_calls(lambda: _sampler(2, 1).check_saved_state(states[1], batch_size=BATCH), 200_000)


def test_shared_sublists_cost_one_step_each():
    """60 levels of ``[d, d]``: 2^60 paths, 61 containers."""
    d: list = [{"leaf": 1}]
    for _ in range(60):
        d = [d, d]
    states = _states()
    states[1]["dataset_state"] = _roundtrip(d)
    found, calls = counted_calls(lambda: ElasticSampler.find_state(states[1]), 20_000)
    assert found is not None
    assert sum(1 for _ in walk_state(d, "d")) == 62


def test_a_sampler_state_shared_by_two_parents_is_found_once():
    states = _states()
    st = _sampler_state(states[1])
    states[1]["dataset_state"] = [st, {"again": st}]  # one object, three references
    found, _ = ElasticSampler.find_state(_roundtrip(states[1]))
    assert found["consumed"] == st["consumed"]


def test_nesting_deeper_than_the_limit_is_refused():
    deep: list = []
    for _ in range(MAX_STATE_DEPTH + 5):
        deep = [deep]
    states = _states()
    states[1]["dataset_state"] = deep
    with pytest.raises(CorruptCheckpointError, match="nests deeper"):
        _sampler(3, 0).elastic_resume(states, batch_size=BATCH, where="ckpt")


def _row(blob: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(len(blob).to_bytes(ROW_HEADER, "little") + blob), dtype=torch.uint8).view(1, -1)


def test_a_decoded_loader_row_is_walked_once_for_cycles():
    """Any loader, not only ours: a cyclic state is refused where the row is decoded, naming it."""
    with pytest.raises(CorruptCheckpointError, match=r"dataloader\.rows\[3\].*contains itself"):
        counted_calls(lambda: decode_dataloader_row(_row(_saved({"a": _cyclic()})), key="dataloader.rows[3]"), 100_000)


# -- tensors from the state -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "done",
    [
        torch.zeros(1, dtype=torch.uint8).expand(1 << 20),  # a few bytes saved, 8 MiB once unpacked
        torch.zeros(1 << 16, dtype=torch.uint8),  # contiguous, but far more than ceil(56 / 8)
        torch.zeros(14, dtype=torch.uint8)[::2],  # the right size, not contiguous
        torch.zeros(7, dtype=torch.int64),  # another dtype
        torch.zeros((7, 1), dtype=torch.uint8),
    ],
    ids=["stride0", "oversized", "strided", "int64", "2d"],
)
def test_the_done_bitmap_is_contiguous_uint8_of_the_epochs_size(done):
    states = _states()
    for ls in states:
        _v1(done=_roundtrip(done))(ls)
    sampler = _sampler(3, 0)
    with TorchWork() as work, pytest.raises(CorruptCheckpointError, match="'done' bitmap"):
        sampler.elastic_resume(states, batch_size=BATCH, where="ckpt")
    assert work.elements < 10_000, f"{work.elements} tensor elements produced"
    with pytest.raises(ValueError, match="'done' bitmap"):
        EpochPosition.from_state({"epoch": 0, "segments": [], "done": done}, N)


def test_a_valid_bitmap_still_restores():
    pos = EpochPosition(0).advanced(2, [3, 3], N)
    for _ in range(20):  # past MAX_SEGMENTS: folded into the bitmap
        pos = pos.advanced(1, [1], N)
    assert pos.done is not None and pos.done.numel() == 7
    back = EpochPosition.from_state(_roundtrip(pos.to_state()), N)
    assert (back.epoch, back.segments) == (pos.epoch, pos.segments) and torch.equal(back.done, pos.done)


# -- the dataloader row's archive -------------------------------------------------------------------


def test_a_deflate_bomb_in_a_loader_row_is_refused_before_it_inflates():
    bomb_bytes = 4 * MAX_INFLATION
    bomb = _deflated({"x": b"\0" * bomb_bytes})
    assert len(bomb) < bomb_bytes // 100
    row = _row(bomb)
    _, peak, err = python_peak(lambda: decode_dataloader_row(row, key="dataloader.rows[1]"))
    assert isinstance(err, CorruptCheckpointError) and err.key == "dataloader.rows[1]", err
    assert "decode to" in str(err)
    assert peak < bomb_bytes // 2, f"{peak} bytes of Python memory"


# -- generator slots ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cuda²", "cuda٣", "cuda01", "cuda"])
def test_a_cuda_slot_name_is_ascii_digits_as_written(name):
    layout = [list(s) for s in rng_layout()] + [[name, "uint8", 16]]
    with pytest.raises(ValueError, match="not a generator"):
        check_layout(layout)
    state = {**capture_rng(), name: torch.zeros(16, dtype=torch.uint8)}
    with pytest.raises(CorruptCheckpointError, match=r"rng\.rank0"):
        checked_rng({"rank0": state}, None, "loc")  # schema 1: names come from manifest keys


def test_restore_rng_parses_every_name_before_it_sets_a_generator():
    state = {**capture_rng(), "cuda²": torch.zeros(16, dtype=torch.uint8)}
    random.seed(5)
    before = random.getstate()
    with pytest.raises(ValueError, match="cuda²"):
        restore_rng(state)
    assert random.getstate() == before, "Python's generator untouched"


# -- TokenStream ----------------------------------------------------------------------------------------

SEQ = 8
LENGTHS = [5, 17, 9]


def _shards(root) -> list[str]:
    names = []
    for k, n in enumerate(LENGTHS):
        (root / f"s{k}.bin").write_bytes(np.arange(n * SEQ, dtype=np.uint16).tobytes())
        names.append(f"s{k}.bin")
    return names


def _token_state(root, names) -> dict:
    ds = TokenStream(str(root), names, seq_len=SEQ, block=4)
    it = iter(ds)
    for _ in range(7):
        next(it)
    return _roundtrip(ds.state_dict())


TOKEN_CASES = [
    ("base_inf", {"base": [float("inf"), 0, 0]}, "base"),  # OverflowError
    ("base_past_shard", {"base": [0, 18, 0]}, r"base\[1\].*'s1.bin' holds 17"),  # "256 of 256 read"
    ("base_huge", {"base": [0, 2**70, 0]}, r"base\[1\]"),
    ("base_float", {"base": [0.5, 0, 0]}, r"base\[0\]"),
    ("progress_past_shard", {"progress": {"0": 6}}, r"progress\['0'\]"),
    ("progress_behind_base", {"base": [3, 0, 0], "progress": {"0": 2}}, r"progress\['0'\]"),
    ("progress_key_unicode", {"progress": {"٠": 2}}, "progress key"),  # int() reads it as 0
    ("progress_key_padded", {"progress": {"00": 2}}, "progress key"),
    ("progress_not_dict", {"progress": [[0, 2]]}, "progress must be"),
    ("sizes_short", {"sizes": [1]}, "sizes must be"),
]


@pytest.mark.parametrize(("case", "edit", "field"), TOKEN_CASES, ids=[c[0] for c in TOKEN_CASES])
def test_token_counts_must_fit_their_shards(tmp_path, case, edit, field):
    names = _shards(tmp_path)
    state = {**_token_state(tmp_path, names), **edit}
    with pytest.raises(CorruptCheckpointError, match=field):
        TokenStream(str(tmp_path), names, seq_len=SEQ).load_state_dict(state)
    fresh = TokenStream(str(tmp_path), names, seq_len=SEQ)
    with pytest.raises(CorruptCheckpointError, match=rf"old rank 0.*{field}"):
        fresh.elastic_resume([{"w": state}], where="ckpt")
    assert fresh._base == [0, 0, 0], "nothing applied"


def test_a_replaced_shard_is_refused_by_name(tmp_path):
    names = _shards(tmp_path)
    state = _token_state(tmp_path, names)
    assert state["sizes"] == [n * SEQ * 2 for n in LENGTHS]
    (tmp_path / "s1.bin").write_bytes(np.arange(20 * SEQ, dtype=np.uint16).tobytes())  # 20 sequences now
    with pytest.raises(CheckpointError, match="'s1.bin' is 320 bytes, 272 when the state was saved"):
        TokenStream(str(tmp_path), names, seq_len=SEQ).load_state_dict(state)
    with pytest.raises(CheckpointError, match="'s1.bin'.*replaced"):
        TokenStream(str(tmp_path), names, seq_len=SEQ).elastic_resume([state], where="ckpt")


def test_a_state_saved_before_sizes_were_recorded_still_restores(tmp_path):
    names = _shards(tmp_path)
    state = _token_state(tmp_path, names)
    del state["sizes"]
    ds = TokenStream(str(tmp_path), names, seq_len=SEQ, block=4)
    ds.load_state_dict(state)
    assert len(list(ds)) == sum(LENGTHS) - 7
    state["base"] = [0, 18, 0]  # what can be checked still is
    with pytest.raises(CorruptCheckpointError, match=r"base\[1\]"):
        ds.load_state_dict(state)
