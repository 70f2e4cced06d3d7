"""Two-tier checkpoints (issue 18): node-local saves, replicas, persistent saves, and restores
that fall back tier by tier, on 4 real gloo ranks laid out as 2 simulated nodes (``{node}`` in
``local_dir``, ``local_world_size=2``).

One saving run (7 steps, every step saved, ``replicas=1``, ``persist_every=3``, ``keep_last=3``)
leaves steps 4-6 on both nodes' local tiers and steps 2 and 5 persisted. Each failure scenario
works on a copy of that state, restores on 4 fresh ranks (all scenarios one after the other, in
one job: ``restored``) and compares the restored model and optimizer with the state the saving
run had at that step.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import tiers_job
from helpers.dist import run_ranks
from helpers.logs import logged_warnings
from helpers.tiers import job_dir

from goodput_ckpt import CheckpointManager
from goodput_ckpt.manager.tiers.nodes import NodeLayout, local_root
from goodput_ckpt.storage import open_store

pytestmark = pytest.mark.multiproc

WORLD = 4
STEPS = 7
OPTS = dict(replicas=1, persist_every=3, keep_last=3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiers")
    run_ranks(
        tiers_job.save_steps,
        WORLD,
        str(base / "persist"),
        str(base / "local" / "node{node}"),
        STEPS,
        OPTS,
        str(base),
        report_dir=base / "report",
    )
    return base


def _scenario(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    shutil.copytree(saved / "persist", tmp_path / "persist")
    shutil.copytree(saved / "local", tmp_path / "local")
    return tmp_path / "persist", tmp_path / "local"


def _damage_every_data_file(node_dir: Path) -> list[Path]:
    hit = []
    for f in sorted(node_dir.rglob("*.bin")):
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
        hit.append(f)
    return hit


def _nothing(where: Path, persist: Path, local: Path) -> dict:
    return {}


def _lose_node1(where: Path, persist: Path, local: Path) -> dict:
    shutil.rmtree(local / "node1")
    return {}


def _lose_local(where: Path, persist: Path, local: Path) -> dict:
    shutil.rmtree(local)
    return {}


def _another_valid_record(where: Path, persist: Path, local: Path) -> dict:
    record = job_dir(local / "node1") / "step_00000006" / "manifest.json"
    shutil.copyfile(job_dir(local / "node1") / "step_00000005" / "manifest.json", record)
    agreed = (job_dir(local / "node0") / "step_00000006" / "manifest.json").read_bytes()
    assert record.read_bytes() != agreed
    return {"record": record, "agreed": agreed}


def _damage_a_local_file(where: Path, persist: Path, local: Path) -> dict:
    (bad,) = (job_dir(local / "node0") / "step_00000006").glob("rank00000-*.bin")
    raw = bytearray(bad.read_bytes())
    raw[100] ^= 0x10
    bad.write_bytes(bytes(raw))
    return {"bad": bad}


def _lose_node1_and_damage_node0(where: Path, persist: Path, local: Path) -> dict:
    shutil.rmtree(local / "node1")
    assert _damage_every_data_file(local / "node0")
    return {}


def _lose_local_and_damage_persistent(where: Path, persist: Path, local: Path) -> dict:
    shutil.rmtree(local)
    (bad,) = (persist / "step_00000005").glob("rank00002-*.bin")
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 3] ^= 0x04
    bad.write_bytes(bytes(raw))
    return {}


def _new_job(where: Path, persist: Path, local: Path) -> dict:
    shutil.rmtree(local / "node1")
    return {"root": where / "fresh-root"}


def _damage_the_replicas(where: Path, persist: Path, local: Path) -> dict:
    shutil.rmtree(local / "node1")
    for step_dir in persist.glob("step_*"):  # the steps, not the root's job file: still this job
        shutil.rmtree(step_dir)
    for f in (local / "node0").rglob("rank0000[23]-*.bin"):
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0x01
        f.write_bytes(bytes(raw))
    return {}


#: The restore scenarios: name -> (what is done to a copy of the saved state, the fault a rank
#: raises). "nothing-lost" comes first: it checks the collectives and that torch warned of
#: nothing, in a process that has restored nothing before.
SCENARIOS = {
    "nothing-lost": (_nothing, None),
    "lost-node": (_lose_node1, None),
    "unreadable-local": (_nothing, (2, "inventory")),
    "foreign-error": (_nothing, (3, "reader")),
    "another-record": (_another_valid_record, None),
    "damaged-local": (_damage_a_local_file, None),
    "lost-node-damaged-survivor": (_lose_node1_and_damage_node0, None),
    "both-local-lost": (_lose_local, None),
    "damaged-persistent": (_lose_local_and_damage_persistent, None),
    "new-job": (_new_job, None),
    "damaged-replica": (_damage_the_replicas, None),
}


@pytest.fixture(scope="module")
def restored(saved, tmp_path_factory) -> dict[str, tuple[list[dict], Path, Path, dict]]:
    """Scenario -> (each rank's ``restore_step`` result, its persistent root, its local
    directory, what its preparation returned). Each scenario works on its own copy of ``saved``;
    all restore in one job of 4 fresh ranks (``restore_each``), one after the other."""
    cases, made = [], {}
    for name, (prepare, fault) in SCENARIOS.items():
        where = tmp_path_factory.mktemp(name)
        persist, local = _scenario(saved, where)
        info = prepare(where, persist, local)
        root = info.pop("root", persist)
        cases.append((str(root), str(local / "node{node}"), OPTS, str(where), 64, fault))
        made[name] = (where, persist, local, info)
    run_ranks(tiers_job.restore_each, WORLD, cases, report_dir=made["nothing-lost"][0] / "report", timeout=540)
    return {
        name: ([json.loads((where / f"restored-rank{r}.json").read_text()) for r in range(WORLD)], persist, local, info)
        for name, (where, persist, local, info) in made.items()
    }


def test_saves_land_on_each_tier(saved):
    tiers = [json.loads((saved / f"tiers-rank{r}.json").read_text()) for r in range(WORLD)]
    for view in tiers:
        assert view["5"] == ["local", "persistent"]
        assert view["6"] == ["local"]
        assert view["2"] == ["persistent"]
    persisted = sorted(p.name for p in (saved / "persist").glob("step_*"))
    assert persisted == ["step_00000002", "step_00000005"]
    for node in (0, 1):
        steps = sorted(p.name for p in job_dir(saved / "local" / f"node{node}").glob("step_*"))
        assert steps == ["step_00000004", "step_00000005", "step_00000006"]
        # every rank's files are on both nodes: its own node's, and the previous node's replicas
        names = {
            p.name.split(".")[0] for p in (job_dir(saved / "local" / f"node{node}") / "step_00000006").glob("*.bin")
        }
        assert names == {f"rank{r:05d}-00" for r in range(WORLD)}


def test_nothing_lost_restores_newest_from_local(restored):
    results, _, _, _ = restored["nothing-lost"]
    want = tiers_job.reference_digest(7)
    for r in results:
        assert r["error"] is None and r["step"] == 6
        assert r["digest"] == want
        assert set(r["record"]["sources"]) == {"local"}
        assert r["warnings"] == [] and r["user_warnings"] == []
        # With nothing to repair, a restore synchronizes the ranks 7 times (on 2 cores with 4
        # ranks each one costs milliseconds): the persistent listing rides on the inventory
        # gather, no second repair gather when nothing is missing, no barrier for commit
        # records (the load is given the agreed one), each of the load's two parts (the per-rank
        # rows, decoded and checked, then the tensors: state/apply.py) with its outcome in one
        # gather, and the loads run without dcp.load's plan gather and scatter. 14 before.
        assert sum(r["collectives"].values()) <= 7, r["collectives"]
        assert r["collectives"].get("all_gather_object", 0) >= 3, r["collectives"]  # the counting saw them
        assert r["torch_warnings"] == []  # the per-rank load is deliberate: torch's warning is not shown


def test_lost_node_restores_newest_from_replicas(restored):
    results, _, local, _ = restored["lost-node"]
    want = tiers_job.reference_digest(7)
    for rank, r in enumerate(results):
        assert r["error"] is None and r["step"] == 6
        assert r["digest"] == want
        if rank >= 2:  # node 1's ranks: their files came from node 0's copies
            assert "replica" in r["record"]["sources"] and "persistent" not in r["record"]["sources"]
        else:
            assert set(r["record"]["sources"]) == {"local"}
        assert r["user_warnings"] == []  # one channel: the log
    # exactly one warning, on node 1's first rank: the node, the step and the tier used
    warned = [w for r in results for w in r["warnings"]]
    assert len(warned) == 1 and warned == results[2]["warnings"], warned
    assert "restore of step 6: node 1 holds no copy of it" in warned[0] and "another node's replica" in warned[0]
    assert len(warned[0]) < 300, warned
    # node 1's ranks loaded what they received from memory: nothing was written to the lost
    # node's directory and read back, and no copy there claims to be whole
    assert not list((local / "node1").rglob("*.bin")) and not list((local / "node1").rglob("manifest.json"))


def test_unreadable_local_tier_on_one_node_reads_from_the_replicas(restored):
    """Listing node 1's local directory raises an OSError (a disk error, not one of ours) on the
    rank that lists it, before the first collective: that rank must not leave the others
    waiting. Node 1's steps count as absent from the inventory, with a warning; each file its
    ranks read is still taken from its copy when that file is there and intact (here: all)."""
    results, _, _, _ = restored["unreadable-local"]
    want = tiers_job.reference_digest(7)
    for r in results:
        assert r["error"] is None and r["step"] == 6, r["error"]
        assert r["digest"] == want
    assert any("node 1's local tier cannot be read" in w and "Input/output error" in w for w in results[2]["warnings"])


def test_a_load_that_raises_a_foreign_error_fails_every_rank_with_its_reason(restored):
    """One rank's load raises a plain RuntimeError (not a CheckpointError): every rank raises a
    CheckpointError that names that rank and the cause, instead of that rank leaving alone."""
    results, _, _, _ = restored["foreign-error"]
    for rank, r in enumerate(results):
        assert r["step"] is None and r["error"] is not None
        assert "reader exploded" in r["error"], r["error"]
        if rank != 3:
            assert "rank 3" in r["error"], r["error"]


def test_a_node_holding_another_valid_record_of_the_step_gets_the_agreed_one(restored):
    """Node 1's step 6 holds a valid commit record that is not node 0's (here step 5's record,
    sealed and whole): the restore loads with node 0's record and writes it over node 1's, so
    the copy on disk never pairs one save's record with another's data files."""
    results, _, _, info = restored["another-record"]
    record, agreed = info["record"], info["agreed"]
    want = tiers_job.reference_digest(7)
    for r in results:
        assert r["error"] is None and r["step"] == 6, r["error"]
        assert r["digest"] == want
    assert record.read_bytes() == agreed


def test_damaged_local_file_comes_from_its_replica(restored):
    results, _, _, info = restored["damaged-local"]
    bad = info["bad"]
    want = tiers_job.reference_digest(7)
    for r in results:
        assert r["error"] is None and r["step"] == 6 and r["digest"] == want
    # rank 0 reads only its own file (the small replicated optimizer values are all in it, see
    # dcp/save_planner.py), and that file came from its replica
    assert results[0]["record"]["sources"] == {"replica": 1}
    # one warning (node 0's first rank), naming the file, the damaged bytes' keys and the tier used
    warned = [w for r in results for w in r["warnings"]]
    assert len(warned) == 1 and warned == results[0]["warnings"], warned
    assert f"node 0's copy of {bad.name} is damaged (bytes [" in warned[0] and "keys: " in warned[0], warned
    assert "padding only" not in warned[0] and warned[0].endswith("read from another node's replica"), warned
    assert all(r["user_warnings"] == [] for r in results)
    assert set(results[2]["record"]["sources"]) == {"local"}


def test_lost_node_and_damaged_survivor_fall_back_to_persistent(restored):
    results, _, local, _ = restored["lost-node-damaged-survivor"]
    want = tiers_job.reference_digest(6)  # step 5, the newest persisted
    for r in results:
        assert r["error"] is None and r["step"] == 5
        assert r["digest"] == want
        assert "persistent" in r["record"]["sources"]
    # node 0's ranks were told which local file was bad, where, and that the next tier was used
    warned = results[0]["warnings"]
    assert any(
        "node 0's copy of" in w and "is damaged" in w and "read from the persistent tier" in w for w in warned
    ), warned
    assert all(len(w) < 400 and "Restore an earlier" not in w for r in results for w in r["warnings"]), warned
    # the steps after it, which no tier could rebuild, are gone from the local tier
    assert not (job_dir(local / "node0") / "step_00000006").exists()


def test_both_local_tiers_lost_restore_newest_persistent(restored):
    results, _, local, _ = restored["both-local-lost"]
    want = tiers_job.reference_digest(6)
    for r in results:
        assert r["error"] is None and r["step"] == 5
        assert r["digest"] == want
        assert set(r["record"]["sources"]) == {"persistent"}
    # read straight from the persistent tier (checked as read), not copied to the local tier first
    assert not list(local.rglob("*.bin")), list(local.rglob("*.bin"))


def test_damaged_persistent_file_read_directly_passes_to_an_older_step(restored):
    """Both local tiers lost, and rank 2's file of persistent step 5 damaged: the load, reading
    it straight from the persistent tier, finds the mismatch; step 5 has no intact copy, so
    every rank restores the older persisted step 2, and says why step 5 was passed."""
    results, _, _, _ = restored["damaged-persistent"]
    want = tiers_job.reference_digest(3)
    for r in results:
        assert r["error"] is None and r["step"] == 2, r["error"]
        assert r["digest"] == want


def test_a_new_job_on_the_same_local_dirs_restores_nothing(restored):
    """Issue 32: job B (a fresh root) on job A's local directories, with node 1 lost so that
    node 0 holds A's replicas of node 1's files too: B restores none of A's steps, and leaves
    them where they are."""
    results, _, local, _ = restored["new-job"]
    assert all(r["step"] is None and r["error"] is None for r in results), results
    assert (job_dir(local / "node0") / "step_00000006" / "manifest.json").exists()


def test_damaged_replica_is_not_used(restored):
    """Node 1 lost, node 0's copies of node 1's files damaged, nothing persisted: the newest
    local steps cannot be rebuilt, and the restore says so instead of loading bad bytes."""
    results, _, _, _ = restored["damaged-replica"]
    for r in results:
        assert r["step"] is None
        assert "no checkpoint can be rebuilt from any tier" in r["error"]
        # rank 2 needs its own file, whose only copy (node 0's) is damaged: named, with its bytes
        assert "step 6: rank 2 could not get its files" in r["error"], r["error"]
        assert "rank00002-00." in r["error"] and "checksum mismatch" in r["error"] and "bytes [0, " in r["error"], r[
            "error"
        ]


# -- without processes ---------------------------------------------------------------------------


def test_layout_ring_and_errors():
    lay = NodeLayout(rank=3, world_size=8, local_world_size=2, replicas=2)
    assert lay.node == 1 and lay.nodes == 4
    assert lay.replica_holders(3) == [5, 7]
    assert lay.replica_holders(7) == [1, 3]
    with pytest.raises(ValueError, match="whole number of nodes"):
        NodeLayout(rank=0, world_size=6, local_world_size=4)
    with pytest.raises(ValueError, match="needs at least 2 nodes"):
        NodeLayout(rank=0, world_size=4, local_world_size=4, replicas=1)


def test_local_dir_template():
    assert local_root("/x/{node}/ckpt", 3) == "/x/3/ckpt"
    assert local_root("/x/ckpt", 3) == "/x/ckpt"
    with pytest.raises(ValueError, match="only {node}"):
        local_root("/x/{rank}", 0)
    with pytest.raises(ValueError, match="not a valid template"):
        local_root("/x/{node", 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(replicas=1), "need local_dir"),
        (dict(persist_every=2), "need local_dir"),
        (dict(local_dir="L", persist_every=0), "persist_every must be a positive integer"),
        (dict(local_dir="L", replicas=-1), "replicas must be a non-negative integer"),
        (dict(local_dir="L", replicas=1), "needs at least 2 nodes"),
    ],
)
def test_bad_options(tmp_path, kwargs, match):
    if "local_dir" in kwargs:
        kwargs["local_dir"] = str(tmp_path / kwargs["local_dir"])
    with pytest.raises(ValueError, match=match):
        CheckpointManager(tmp_path / "root", **kwargs)


def test_one_process_two_tiers(tmp_path):
    """One process (no group): saves land locally, every 2nd is persisted, restore prefers local."""
    import torch

    model, opt = tiers_job.make(0)
    with CheckpointManager(tmp_path / "root", local_dir=str(tmp_path / "local"), persist_every=2, keep_last=2) as mgr:
        for step in range(4):
            tiers_job.train(model, opt, step)
            mgr.save(step, model=model, optimizer=opt)
        mgr.wait()
        assert mgr.step_tiers() == {1: ("persistent",), 2: ("local",), 3: ("local", "persistent")}
    assert open_store(str(tmp_path / "root"), {}).list()  # the persistent tier exists
    fresh, fresh_opt = tiers_job.make(0)
    torch.nn.init.zeros_(fresh[0].weight)
    with (
        warnings.catch_warnings(record=True) as caught,
        CheckpointManager(tmp_path / "root", local_dir=str(tmp_path / "local"), persist_every=2) as mgr,
    ):
        warnings.simplefilter("always")
        assert mgr.restore(model=fresh, optimizer=fresh_opt) == 3
        assert mgr.timeline[-1]["sources"] == {"local": 1}
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]
    assert tiers_job.digest(fresh, fresh_opt) == tiers_job.reference_digest(4)


def test_one_process_damaged_local_copy_warns_once(tmp_path):
    """Same-size damage in the local copy is found by the load itself; the file comes from the
    persistent tier, and one log record names it, the keys hit and the tier used (issue 32:
    before, a log record and a UserWarning of about 600 characters each, with advice the
    restore was already following)."""
    import torch

    model, opt = tiers_job.make(0)
    with CheckpointManager(tmp_path / "root", local_dir=str(tmp_path / "local"), persist_every=2, keep_last=2) as mgr:
        for step in range(4):
            tiers_job.train(model, opt, step)
            mgr.save(step, model=model, optimizer=opt)
    (bad,) = (job_dir(tmp_path / "local") / "step_00000003").glob("*.bin")
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    bad.write_bytes(bytes(raw))
    fresh, fresh_opt = tiers_job.make(0)
    torch.nn.init.zeros_(fresh[0].weight)
    with CheckpointManager(tmp_path / "root", local_dir=str(tmp_path / "local"), persist_every=2) as mgr:
        with logged_warnings(bad.name) as records:
            assert mgr.restore(model=fresh, optimizer=fresh_opt) == 3
        assert mgr.timeline[-1]["sources"] == {"persistent": 1}
    (named,) = [r.getMessage() for r in records if bad.name in r.getMessage()]
    # the damaged range is named with the tensors it hits, and the tier the file came from
    assert "is damaged (bytes [" in named and "keys: " in named and "padding only" not in named, named
    assert named.endswith("read from the persistent tier") and len(named) < 300, named
    assert tiers_job.digest(fresh, fresh_opt) == tiers_job.reference_digest(4)


def test_ls_shows_tiers(saved):
    from goodput_ckpt.tools.ops.ls import list_checkpoints

    report = list_checkpoints(str(saved / "persist"), local_dir=str(saved / "local" / "node{node}"))
    got = {c.step: (c.status, c.tiers) for c in report.checkpoints}
    assert got == {
        2: ("complete", ["persistent"]),
        4: ("local", ["node 0", "node 1"]),
        5: ("complete", ["persistent", "node 0", "node 1"]),
        6: ("local", ["node 0", "node 1"]),
    }
    plain = list_checkpoints(str(saved / "persist"))
    assert [c.step for c in plain.checkpoints] == [2, 5] and all(c.tiers == [] for c in plain.checkpoints)


def test_timeline_records_each_tier(saved):
    from goodput_ckpt.manager.timeline import read_timeline

    records = read_timeline(saved / "persist" / "goodput-timeline.jsonl")
    saves = [r for r in records if r["event"] == "save"]
    assert len(saves) == WORLD * STEPS and all(r["ok"] and r["tier"] == "local" for r in saves)
    assert all(r["replicate_s"] is not None and r["replicate_s"] >= 0 for r in saves)
    persists = [r for r in records if r["event"] == "persist"]
    assert sorted((r["step"], r["rank"]) for r in persists) == [(s, r) for s in (2, 5) for r in range(WORLD)]
    assert all(r["ok"] and r["bytes"] > 0 and r["seconds"] > 0 for r in persists)


def test_local_copy_that_cannot_be_committed_does_not_fail_the_restore(tmp_path):
    """A node's copy holds the data but its commit record cannot be written back (here a
    directory stands where the record goes): the restore still loads the step from that copy,
    with the agreed record, and a warning says the copy stays uncommitted."""
    import torch

    model, opt = tiers_job.make(0)
    with CheckpointManager(tmp_path / "root", local_dir=str(tmp_path / "local"), persist_every=2, keep_last=2) as mgr:
        for step in range(4):
            tiers_job.train(model, opt, step)
            mgr.save(step, model=model, optimizer=opt)
    record = job_dir(tmp_path / "local") / "step_00000003" / "manifest.json"
    record.unlink()
    record.mkdir()  # not a file: writing the record there fails
    fresh, fresh_opt = tiers_job.make(0)
    torch.nn.init.zeros_(fresh[0].weight)
    with CheckpointManager(tmp_path / "root", local_dir=str(tmp_path / "local"), persist_every=2) as mgr:
        with logged_warnings("could not be committed"):
            assert mgr.restore(model=fresh, optimizer=fresh_opt) == 3
        assert mgr.timeline[-1]["sources"] == {"local": 1}
    assert tiers_job.digest(fresh, fresh_opt) == tiers_job.reference_digest(4)


def test_one_process_lost_local_directory_warns_once_naming_node_step_and_tier(tmp_path):
    """The whole local directory is gone: the restore reads the step from the persistent tier
    and says so in one log record (issue 32: before, nothing at all)."""
    import torch

    model, opt = tiers_job.make(0)
    with CheckpointManager(tmp_path / "root", local_dir=str(tmp_path / "local"), persist_every=1, keep_last=2) as mgr:
        for step in range(2):
            tiers_job.train(model, opt, step)
            mgr.save(step, model=model, optimizer=opt)
    shutil.rmtree(tmp_path / "local")
    fresh, fresh_opt = tiers_job.make(0)
    torch.nn.init.zeros_(fresh[0].weight)
    with CheckpointManager(tmp_path / "root", local_dir=str(tmp_path / "local")) as mgr:
        with logged_warnings("holds no copy") as records:
            assert mgr.restore(model=fresh, optimizer=fresh_opt) == 1
    (warned,) = [r.getMessage() for r in records]
    assert warned.startswith("restore of step 1: node 0 holds no copy of it") and "the persistent tier" in warned
    assert tiers_job.digest(fresh, fresh_opt) == tiers_job.reference_digest(2)
