"""What each rank reports to the coordinator (dcp/rank_reports.py): its rows only when the
coordinator does not hold its layout, so that from the second save of a layout on the write
results gathered do not grow with tensors (issue 37). The bytes counted here are the results as
DCP's gather pickles them; the saves are real ``dcp.save`` calls in one process.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointError, CheckpointReader, CheckpointWriter
from goodput_ckpt.dcp import commit_build
from goodput_ckpt.dcp.rank_reports import RankReport
from goodput_ckpt.format.manifest import MANIFEST_NAME, parse_manifest


class _Recording(CheckpointWriter):
    """The project's writer, with what its rank handed to DCP's gather written down."""

    sent: list[RankReport] = []
    sent_bytes: list[int] = []

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        results = fut.value()
        type(self).sent.append(results[0].storage_data)
        type(self).sent_bytes.append(len(pickle.dumps(results)))
        return fut


def _state(tensors: int, seed: int, *, requires_grad: bool = False, dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {f"t{i:03d}": torch.randn(5, 3, generator=g).to(dtype).requires_grad_(requires_grad) for i in range(tensors)}
    out["step"] = torch.tensor(seed)
    return out


def _save(path: Path, state: dict) -> RankReport:
    _Recording.sent.clear()
    _Recording.sent_bytes.clear()
    dcp.save(state, storage_writer=_Recording(path), no_dist=True)
    return _Recording.sent[-1]


def _load(path: Path, like: dict) -> dict:
    out = {k: torch.zeros_like(v.detach()) for k, v in like.items()}
    dcp.load(out, storage_reader=CheckpointReader(path), no_dist=True)
    return out


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k].detach()) for k in b)


def test_a_later_save_of_the_same_layout_sends_no_rows_and_loads_bit_exact(tmp_path: Path) -> None:
    commit_build.forget_layouts()
    sizes = {}
    for tensors in (4, 64):
        first = _save(tmp_path / f"a{tensors}", _state(tensors, 1))
        assert first.writes is not None  # the coordinator held nothing: every row
        first_bytes = _Recording.sent_bytes[-1]
        later = _save(tmp_path / f"b{tensors}", _state(tensors, 2))
        assert later.writes is None and later.files  # its files and digest only
        sizes[tensors] = (first_bytes, _Recording.sent_bytes[-1])
        assert _same(_load(tmp_path / f"b{tensors}", _state(tensors, 2)), _state(tensors, 2))
    assert sizes[64][0] > 1.3 * sizes[4][0]  # rows grow with tensors (packed: zlib, rank_reports.py)
    assert abs(sizes[64][1] - sizes[4][1]) <= 8  # a later report does not (a file size's int may take a byte more)


@pytest.mark.parametrize(
    "change",
    [{"requires_grad": True}, {"dtype": torch.float16}],
    ids=["requires_grad", "dtype-of-another-kind"],
)
def test_a_change_the_rows_do_not_show_sends_the_rows_again(tmp_path: Path, change: dict) -> None:
    # bfloat16 -> float16 and a requires_grad flag change no offset, length or key: only the
    # digest of the items' properties tells them apart.
    commit_build.forget_layouts()
    base = {"dtype": torch.bfloat16} if "dtype" in change else {}
    _save(tmp_path / "a", _state(6, 1, **base))
    assert _save(tmp_path / "b", _state(6, 2, **base)).writes is None
    changed = _state(6, 3, **change)
    assert _save(tmp_path / "c", changed).writes is not None
    m = parse_manifest((tmp_path / "c" / MANIFEST_NAME).read_bytes())
    entry = m.items["t000"]
    assert entry.dtype == str(changed["t000"].dtype).removeprefix("torch.")
    assert entry.requires_grad == changed["t000"].requires_grad
    assert _same(_load(tmp_path / "c", changed), changed)


def _results(report: RankReport):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from goodput_ckpt.dcp.rank_reports import RANK_WRITES_KEY

    return [[WriteResult(index=MetadataIndex(RANK_WRITES_KEY), size_in_bytes=0, storage_data=report)]]


def _metadata(path: Path):
    return CheckpointReader(path).read_metadata()


def test_rows_left_out_for_a_layout_the_coordinator_does_not_hold_fail_by_name(tmp_path: Path) -> None:
    commit_build.forget_layouts()
    _save(tmp_path / "a", _state(3, 1))
    later = _save(tmp_path / "b", _state(3, 2))
    assert later.writes is None
    commit_build.forget_layouts()  # the coordinator lost its entries (another process, say)
    with pytest.raises(CheckpointError, match="sent only its layout digest"):
        commit_build.build_manifest(
            _metadata(tmp_path / "b"), _results(later), chunk_size=8 << 20, created_at="t", user_metadata={}
        )


def test_the_pinned_layout_serves_its_save_when_another_build_replaced_the_last_one(tmp_path: Path) -> None:
    commit_build.forget_layouts()
    _save(tmp_path / "a", _state(3, 1))
    pinned = commit_build.held_layouts()  # what the coordinator announced to its ranks
    later = _save(tmp_path / "b", _state(3, 2))
    _save(tmp_path / "other", _state(9, 1))  # another state's save in this process, in between
    assert commit_build.held_layouts() is not pinned
    m = commit_build.build_manifest(
        _metadata(tmp_path / "b"), _results(later), chunk_size=8 << 20, created_at="t", user_metadata={}, held=pinned
    )
    assert set(m.items) == set(_state(3, 2)) and set(m.files) == {f.path for f in later.files}


def test_a_report_whose_rows_name_other_files_is_refused(tmp_path: Path) -> None:
    commit_build.forget_layouts()
    first = _save(tmp_path / "a", _state(3, 1))
    forged = RankReport(first.files[:0], first.layout, first.writes)
    with pytest.raises(CheckpointError, match="did not write"):
        commit_build.build_manifest(
            _metadata(tmp_path / "a"), _results(forged), chunk_size=8 << 20, created_at="t", user_metadata={}
        )


def test_rows_go_packed_and_the_held_build_keeps_them_packed(tmp_path: Path) -> None:
    from goodput_ckpt.dcp.rank_reports import PackedWrites, unpack

    commit_build.forget_layouts()
    first = _save(tmp_path / "a", _state(200, 1))
    assert isinstance(first.writes, PackedWrites)
    rows = unpack(first.writes, first.files, 0, {})
    raw = rows.table.nbytes + len(rows.keys) + len(rows.own_keys)  # what a RankWrites pickled as before
    assert len(pickle.dumps(first.writes)) * 3 < raw  # counted, not timed
    held = commit_build.held_layouts()
    assert [type(w) for w in held.writes] == [PackedWrites]  # the tables are not kept between saves
    assert _same(_load(tmp_path / "a", _state(200, 1)), _state(200, 1))


@pytest.mark.parametrize("forge", ["bomb", "rows", "columns"])
def test_packed_rows_that_do_not_decompress_to_their_size_are_refused_naming_the_rank(
    tmp_path: Path, forge: str
) -> None:
    import dataclasses
    import zlib

    commit_build.forget_layouts()
    first = _save(tmp_path / "a", _state(3, 1))
    w = first.writes
    bad = {
        "bomb": dataclasses.replace(w, table=zlib.compress(b"\0" * (w.rows * w.columns * 8 * 50))),
        "rows": dataclasses.replace(w, rows=w.rows + 1),
        "columns": dataclasses.replace(w, columns=1 << 20),
    }[forge]
    commit_build.forget_layouts()
    with pytest.raises(CheckpointError, match="rank 0's write results"):
        commit_build.build_manifest(
            _metadata(tmp_path / "a"),
            _results(RankReport(first.files, first.layout, bad)),
            chunk_size=8 << 20,
            created_at="t",
            user_metadata={},
        )
