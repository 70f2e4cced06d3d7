"""How S3 requests scale with ranks (issue 19): counted per rank, by operation, on the real client.

The same workload (``helpers.s3_requests.count_rank_requests``: ``dcp.save`` and ``dcp.load`` of
FSDP-sharded DTensors, then a ``CheckpointManager`` save and a restore by a new manager) runs on
2 and on 4 gloo ranks against moto. The rules:

- no rank but the coordinator lists anything (``ListObjectsV2``, ``ListMultipartUploads``);
- the coordinator lists the manager root at most once per restore, and lists as often at 4
  ranks as at 2;
- a rank other than the coordinator makes the same requests at 2 and at 4 ranks (O(1) in W):
  no rank reads the manifest, or checks every data file's size, for itself;
- the coordinator's size checks (``HeadObject``) grow by at most one per rank added;
- a steady-state manager save (its fourth, retiring a step) makes the minimum its layout needs,
  W + 4 requests at W ranks (docs/s3.md, *Requests per save*), plus on moto one ``HeadObject``
  per rank (moto confirms no checksum); it lists the root, never the step's location.

``benchmarks/bench_requests.py`` runs the same workload at 2 to 16 ranks and prints the table
in docs/scale.md.
"""

from __future__ import annotations

import json

import pytest
from helpers.dist import run_ranks
from helpers.s3_requests import PHASES, count_rank_requests
from helpers.store_fixtures import S3Target

pytestmark = pytest.mark.multiproc

LISTS = ("ListObjectsV2", "ListObjects", "ListMultipartUploads")
SHAPES = [(f"layers.{i}.weight", (48, 8)) for i in range(12)]
LAYERS = 3


@pytest.fixture(scope="module")
def counts(moto_server, tmp_path_factory) -> dict[int, dict]:
    """The workload's report at 2 and at 4 ranks (one run each, shared by the tests here)."""
    tmp = tmp_path_factory.mktemp("requests")
    target = S3Target("moto", moto_server.url, "goodput-requests")
    target.client().create_bucket(Bucket=target.bucket)
    runs = {}
    for world in (2, 4):
        out = tmp / f"w{world}.json"
        run_ranks(
            count_rank_requests,
            world,
            target.url,
            target.uri(f"w{world}"),
            SHAPES,
            LAYERS,
            str(out),
            report_dir=tmp / f"ranks{world}",
            timeout=300,
        )
        runs[world] = json.loads(out.read_text())
    return runs


def test_only_the_coordinator_lists(counts):
    for w, report in counts.items():
        for phase in PHASES:
            for rank, ops in enumerate(report[phase][1:], start=1):
                listed = {op: n for op, n in ops.items() if op in LISTS}
                assert not listed, f"W={w} {phase}: rank {rank} listed: {listed}"
        roots = [
            n
            for op, where, n in report["keys"][0]["manager.restore"]
            if op == "ListObjectsV2" and where == f"w{w}/mgr/"
        ]
        assert sum(roots) <= 1, f"W={w}: the coordinator listed the manager root {sum(roots)} times in one restore"
    for phase in PHASES:
        lists = [{op: counts[w][phase][0].get(op, 0) for op in LISTS} for w in (2, 4)]
        assert lists[0] == lists[1], f"{phase}: the coordinator's listings grew from 2 to 4 ranks: {lists}"


def test_no_size_check_storm(counts):
    """Only the coordinator checks data files' sizes (one HeadObject each); another rank checks
    at most the file it wrote itself."""
    for w, report in counts.items():
        for phase in PHASES:
            for rank, ops in enumerate(report[phase][1:], start=1):
                assert ops.get("HeadObject", 0) <= 1, f"W={w} {phase}: rank {rank} made {ops['HeadObject']} HeadObject"
    for phase in PHASES:
        heads = counts[4][phase][0].get("HeadObject", 0) - counts[2][phase][0].get("HeadObject", 0)
        assert heads <= 2, f"{phase}: the coordinator's HeadObject grew by {heads} from 2 to 4 ranks"


@pytest.mark.parametrize("phase", [p for p in PHASES if p != "manager.restore"])
def test_other_ranks_requests_do_not_grow_with_ranks(counts, phase):
    small, large = counts[2][phase], counts[4][phase]
    assert small[1] == large[1] == large[3], (
        f"{phase}: a non-coordinator rank's requests, W=2 {small[1]} vs W=4 {large[1:]}"
    )


def test_other_ranks_restore_requests_do_not_grow_with_ranks(counts):
    """The manager saves small replicated values (AdamW's step, param_groups) on the lowest rank
    (dcp/save_planner.py): spread over every rank's file, each rank read from W files."""
    small, large = counts[2]["manager.restore"], counts[4]["manager.restore"]
    assert small[1] == large[1] == large[3], f"W=2 {small[1]} vs W=4 {large[1:]}"


def test_a_steady_manager_save_makes_the_minimum_requests(counts):
    """Fails on the code before: the coordinator listed the step's location before the save
    (W + 5 requests, W + 4 the minimum)."""
    for w, report in counts.items():
        ranks = report["manager.steady"]
        heads = sum(ops.get("HeadObject", 0) for ops in ranks)
        total = sum(sum(ops.values()) for ops in ranks)
        assert heads == w, f"W={w}: {heads} HeadObject (moto: one after each rank's data upload)"
        assert total - heads == w + 4, f"W={w}: {ranks}"
        listed = [
            where for op, where, n in report["keys"][0]["manager.steady"] if op == "ListObjectsV2" for _ in range(n)
        ]
        assert listed == [f"w{w}/mgr/"], f"W={w}: the coordinator listed {listed}"
