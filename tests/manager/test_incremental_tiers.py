"""Incremental saves with two tiers (issue 40): a step that references files of earlier steps
stays loadable from every tier it is restored from (its nodes' local copies, a replica on
another node, the persistent tier alone), retention keeps every base a kept step references on
each tier, and a replica that lacks a referenced file fails that save and makes the next full.

One saving run on 2 real gloo ranks laid out as 2 simulated nodes (8 steps, ``replicas=1``,
``persist_every=3``, ``keep_last=2``, every 4th save full); each restore scenario works on a copy
of what it left and compares the restored state with the same training in this process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tiers_incremental_job as job
from helpers.dist import run_ranks
from helpers.tiers import job_dir

from goodput_ckpt.format.manifest import parse_manifest
from goodput_ckpt.manager.step_layout import parse_step_dir
from goodput_ckpt.tools.ops.verify import verify_checkpoint

pytestmark = pytest.mark.multiproc

WORLD = 2
STEPS = 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("inc-tiers")
    run_ranks(
        job.save_steps,
        WORLD,
        str(base / "persist"),
        str(base / "local" / "node{node}"),
        STEPS,
        str(base),
        report_dir=base / "report",
        timeout=400,
    )
    return base


def _copy(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    shutil.copytree(saved / "persist", tmp_path / "persist")
    shutil.copytree(saved / "local", tmp_path / "local")
    return tmp_path / "persist", tmp_path / "local"


def _lose_node1(local: Path) -> None:
    shutil.rmtree(local / "node1")


def _lose_local(local: Path) -> None:
    shutil.rmtree(local)


#: Restore scenarios: (what is lost before the restore, whether the restored job saves on). The
#: one that saves runs last, so the pure restores run in a process that has not saved yet.
SCENARIOS = {"lost-node": (_lose_node1, False), "lost-local": (_lose_local, False), "nothing-lost": (None, True)}


@pytest.fixture(scope="module")
def restored(saved, tmp_path_factory) -> dict[str, tuple[Path, int, list[dict]]]:
    """Scenario -> (its persistent root, its newest persisted step before the restore, what each
    rank restored). Every scenario restores a copy of ``saved``; all run in one gloo job."""
    cases, out = [], {}
    for name, (lose, go_on) in SCENARIOS.items():
        where = tmp_path_factory.mktemp(name)
        persist, local = _copy(saved, where)
        if lose is not None:
            lose(local)
        newest = max(parse_step_dir(p.name) for p in persist.glob("step_*"))
        cases.append((str(persist), str(local / "node{node}"), str(where), go_on))
        out[name] = (where, persist, newest)
    run_ranks(job.restore_each, WORLD, cases, report_dir=out["lost-node"][0] / "report", timeout=600)
    return {
        name: (persist, newest, [json.loads((where / f"restored-rank{r}.json").read_text()) for r in range(WORLD)])
        for name, (where, persist, newest) in out.items()
    }


def _bases(step_dir: Path) -> set[int]:
    return {parse_step_dir(b) for b in parse_manifest((step_dir / "manifest.json").read_bytes()).bases()}


def test_every_tier_holds_what_its_steps_reference(saved):
    views = [json.loads((saved / f"saved-rank{r}.json").read_text()) for r in range(WORLD)]
    saves = {int(s): v for s, v in views[0]["saves"].items()}
    # Saves 0 and 4 are full; the others reference the frozen layer in them (writer's counters).
    assert [saves[s][1] == 0 for s in range(STEPS)] == [True, False, False, False, True, False, False, False]
    assert saves[5][0] < saves[4][0]
    persist = saved / "persist"
    persisted = sorted(parse_step_dir(p.name) for p in persist.glob("step_*"))
    referencing = [s for s in persisted if _bases(persist / f"step_{s:08d}")]
    assert referencing, persisted  # some persisted step references another
    for s in persisted:  # each persisted step verifies, references included, and its bases are there
        assert verify_checkpoint(str(persist / f"step_{s:08d}")).ok, s
        assert _bases(persist / f"step_{s:08d}") <= set(persisted), s
    for node in range(WORLD):
        local = job_dir(saved / "local" / f"node{node}")
        steps = sorted(parse_step_dir(p.name) for p in local.glob("step_*"))
        assert steps[-2:] == [6, 7], steps  # keep_last=2, and the bases they need
        for s in steps:
            assert _bases(local / f"step_{s:08d}") <= set(steps), (node, s, steps)
        # every rank's files of the newest step are on both nodes: through its base when referenced
        manifest = parse_manifest((local / "step_00000007" / "manifest.json").read_bytes())
        for entry in manifest.files.values():
            assert (local / (entry.base or "step_00000007") / entry.path).stat().st_size == entry.size


def test_nothing_lost_restores_the_newest_incremental_step_from_local(restored):
    _, _, results = restored["nothing-lost"]
    for r in results:
        assert r["error"] is None and r["step"] == STEPS - 1
        assert r["digest"] == job.reference_digest(STEPS)
        assert set(r["sources"]) == {"local"}
        # The save of step 9 references step 8's files, whose replicas were deleted: it fails
        # on every rank, naming the missing replica; step 10 is then full and commits.
        assert "lacks" in r.get("failed", ""), r
        saves = {int(s): v for s, v in r["saves"].items()}
        assert saves[8][1] == 0 and 9 not in saves and saves[10][1] == 0, saves
        assert r["after"] == job.reference_digest(STEPS + 3)


def test_lost_node_restores_from_the_replicas_and_their_bases(restored):
    _, _, results = restored["lost-node"]
    for rank, r in enumerate(results):
        assert r["error"] is None and r["step"] == STEPS - 1
        assert r["digest"] == job.reference_digest(STEPS)
        if rank == 1:  # node 1's rank read node 0's replicas, referenced files included
            assert "replica" in r["sources"] and "persistent" not in r["sources"], r["sources"]


def test_lost_local_tiers_restore_the_newest_persisted_step(restored):
    persist, newest, results = restored["lost-local"]
    assert _bases(persist / f"step_{newest:08d}"), "the newest persisted step should reference a base"
    for r in results:
        assert r["error"] is None and r["step"] == newest
        assert r["digest"] == job.reference_digest(newest + 1)
        assert set(r["sources"]) == {"persistent"}
