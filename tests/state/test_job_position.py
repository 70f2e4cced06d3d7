"""The data position as one job-level entry (issue 34): the ElasticSampler's global record is
written once per job, in the commit record's training-state metadata, and every rank's
dataloader row keeps only its own count; restores of checkpoints whose rows still hold the whole
record (``fixtures/v2_rows``, written by the package before, ``make_v2_rows.py``) give back what
that package gave."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.datasets import Ids
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from goodput_ckpt import CheckpointManager
from goodput_ckpt.data import ElasticSampler

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
