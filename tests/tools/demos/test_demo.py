"""``goodput-ckpt demo``: a real 2-rank job, SIGKILLed and restarted, compared bit for bit.

The default demo trains for about a minute; these runs use a tiny model and few steps so the
three launches (reference, killed, restarted) take seconds each, but everything else is real:
gloo ranks, FSDP2, a StatefulDataLoader with 2 workers, async saves, a SIGKILL of the whole job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from goodput_ckpt.tools.demos.demo import MARKER, DemoConfig, _compare, _prepare, run_demo

pytestmark = pytest.mark.multiproc

SMALL = ["--steps", "24", "--save-every", "5", "--width", "64"]


def _demo_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "goodput_ckpt.tools.demos._demo_job" in line]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("demo") / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "goodput_ckpt.cli", "demo", "--dir", str(work), *SMALL, "--kill-at", "12", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return work, proc


@pytest.mark.timeout(600)
def test_demo_resumes_bit_exactly_and_reports_goodput(demo_run):
    work, proc = demo_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ok"] and report["bit_exact"] and not report["mismatches"]
    # rank 0: parameters, optimizer and scheduler state; every rank: RNG and next batches
    assert report["values_compared"] > 20
    assert report["killed_after_step"] == 12 and report["restored_step"] in (5, 10)
    assert report["save_in_flight_at_kill"] in (None, 10)
    steps = [c["step"] for c in report["checkpoints"]]
    assert steps and steps[-1] == 23 and all(c["ok"] and c["bytes"] > 0 for c in report["checkpoints"])
    s = report["seconds"]
    assert s["total"] > 0 and s["training"] > 0 and s["lost"] > 0 and s["restart"] > 0 and s["restore"] > 0
    assert sum(v for k, v in s.items() if k != "total") == pytest.approx(s["total"])
    assert report["goodput"] == pytest.approx(s["training"] / s["total"])
    assert report["saves_kept"] == len({0, 5, 10, 15, 20, 23} - set(range(report["restored_step"] + 1, 13)))
    assert report["sync_save_s"] > 0 and 0 < report["goodput_sync"] < 1
    # progress went to stderr; the job's processes are gone; logs and the timeline stayed
    assert "==> reference run" in proc.stderr and "SIGKILL" in proc.stderr
    assert _demo_processes() == []
    assert (work / MARKER).exists() and (work / "timeline.jsonl").exists()
    assert sorted(os.listdir(work / "logs"))[:2] == ["launch1-rank0.err", "launch1-rank0.out"]


def test_demo_text_report(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "goodput_ckpt.cli", "demo", "--dir", str(tmp_path / "d"), *SMALL, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in (
        "RESUME OK",
        "KILLED",
        "RESTARTED",
        "all verified",
        "GOODPUT",
        "With synchronous checkpoints",
        "lost work",
    ):
        assert text in proc.stdout
    assert "==>" not in proc.stderr


def test_a_rerun_clears_its_own_directory_but_refuses_others(tmp_path):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "precious.txt").write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "goodput_ckpt.cli", "demo", "--dir", str(other), *SMALL],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "was not made by goodput-ckpt demo" in proc.stderr
    assert (other / "precious.txt").exists() and "Traceback" not in proc.stderr
    # A directory the demo made (its marker) is cleared for the rerun.
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / MARKER).write_text("x")
    (ours / "logs").mkdir()
    (ours / "logs" / "old.err").write_text("old")
    _prepare(str(ours))
    assert sorted(p.name for p in ours.iterdir()) == [MARKER]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"steps": 10, "save_every": 5}, "at least 2 × save_every"),
        ({"width": 63}, "width must be even"),
        ({"kill_at": 2}, r"kill_at must be in .* = \[20, 119\), got 2"),
        ({"steps": 0}, "steps must be a positive integer"),
    ],
)
def test_bad_configurations_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        DemoConfig(**kw)


def test_a_bad_uri_fails_before_any_job_starts(tmp_path):
    with pytest.raises(ValueError, match="unsupported checkpoint URI"):
        run_demo(DemoConfig(workdir=str(tmp_path / "w"), uri="nosuch://x"))
    assert _demo_processes() == []


def test_a_differing_value_is_named(demo_run, tmp_path):
    work, _ = demo_run
    ref = work / "reference"
    changed = tmp_path / "changed"
    changed.mkdir()
    for rank in (0, 1):
        prints = json.loads((ref / f"fingerprint-rank{rank}.json").read_text())
        if rank == 1:
            prints["rng.torch"] = "uint8[5056]:" + "0" * 32
        (changed / f"fingerprint-rank{rank}.json").write_text(json.dumps(prints))
    compared, mismatches = _compare(str(ref), str(changed), 2)
    assert mismatches == ["rank 1: rng.torch"] and compared > 20


# -- demo --tiers: the same job and failure on one tier and on two ---------------------------------

TIER_SMALL = dict(steps=24, save_every=5, width=64, kill_at=12, world_size=2)


@pytest.fixture(scope="module")
def tier_report(tmp_path_factory):
    """One two-tier demo (2 ranks as 2 nodes of 1, the job killed with every local copy intact)."""
    from goodput_ckpt.tools.demos.demo_tiers import run_tier_demo

    work = tmp_path_factory.mktemp("tiers") / "run"
    return run_tier_demo(DemoConfig(workdir=str(work), failure="job", **TIER_SMALL))


def _cli(argv, monkeypatch=None, report=None):
    import io

    from goodput_ckpt.cli._main import main

    if report is not None:
        monkeypatch.setattr("goodput_ckpt.tools.demos.demo_tiers.run_tier_demo", lambda cfg, on_event=None: report)
    out, err = io.StringIO(), io.StringIO()
    return main(["demo", *argv], stdout=out, stderr=err), out.getvalue(), err.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tier_demo_runs_both_modes_bit_exactly(tier_report, monkeypatch):
    rc, out, _ = _cli(["--tiers", "--json"], monkeypatch, tier_report)
    assert rc == 0
    report = json.loads(out)
    assert report["ok"] and report["nodes"] == 2 and report["local_world_size"] == 1 and report["lost_node"] is None
    one, two = report["modes"]
    assert (one["name"], two["name"]) == ("one tier", "two tiers")
    for mode in (one, two):
        assert mode["bit_exact"] and mode["values_compared"] > 20 and mode["restored_step"] in (5, 10)
        s = mode["seconds"]
        assert sum(v for k, v in s.items() if k != "total") == pytest.approx(s["total"])
        assert mode["goodput"] == pytest.approx(s["training"] / s["total"])
        assert mode["stall_per_save_s"] > 0 and mode["background_per_save_s"] > 0
        assert mode["checkpoints"] and all(c["ok"] for c in mode["checkpoints"])
    # one tier reads its root; two tiers, with every local copy intact, read only local files
    assert one["restored_from"] == ["persistent"] and one["restore_files"] == {} and one["local_dir"] is None
    assert two["restored_from"] == ["local"] and two["restore_files"]["local"] > 0
    assert two["persist_every"] == 3 and two["persist_per_save_s"] > 0
    assert {c["tier"] for c in two["checkpoints"]} == {"persistent", "local node 0", "local node 1"}
    # A save persists once 3 were made since the last persisted one, counted across the restart
    # (docs/manager.md, The persist rule): saves 0, 5, 10 then 15, 20, 23. Step 10 persists; when
    # the kill cut its upload (or it never committed), the restart's first save, 15, is the 3rd
    # (or 4th) unpersisted one and persists instead, and 23 is not due.
    persisted = {c["step"] for c in two["checkpoints"] if c["tier"] == "persistent"}
    assert persisted in ({10, 23}, {15}), persisted
    assert report["gain"] == pytest.approx(100 * (two["goodput"] - one["goodput"]))
    model = report["model"]
    assert 0 < model["goodput"] <= 1 and model["persist_every"] >= 1
    assert model["inputs"]["local_restore"] == pytest.approx(two["seconds"]["restore"])
    assert model["inputs"]["restore"] == pytest.approx(one["seconds"]["restore"])


@pytest.mark.slow
def test_tier_demo_text_report(tier_report, monkeypatch):
    rc, out, _ = _cli(["--tiers", "--no-progress"], monkeypatch, tier_report)
    assert rc == 0
    for text in (
        "ONE TIER",
        "TWO TIERS",
        "resumed bit for bit",
        "from persistent",
        "local",
        "stall per save",
        "lost work",
        "GOODPUT",
        "Measured for this failure",
        "checkpoint cost",
        "Two-level model",
        "persist_every",
    ):
        assert text in out, text


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--persist-every", "2"], "--persist-every needs --tiers"),
        (["--failure", "job"], "--failure needs --tiers"),
        (["--tiers", "--ranks", "3"], "the world size must be even, got 3"),
        (["--tiers", "--persist-every", "0"], "persist_every must be a positive integer"),
    ],
)
def test_bad_tier_options_are_refused_before_any_job(argv, match, tmp_path):
    rc, _, err = _cli(["--dir", str(tmp_path / "d"), *argv])
    assert rc == 2 and match in err and "Traceback" not in err
    assert not (tmp_path / "d").exists()  # refused before the work directory, so before any launch


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tier_demo_survives_a_lost_node(tmp_path):
    from goodput_ckpt.tools.demos.demo_tiers import run_tier_demo

    report = run_tier_demo(DemoConfig(workdir=str(tmp_path / "w"), failure="node", **TIER_SMALL))
    one, two = report.modes
    assert report.ok and report.lost_node == 1
    assert one.restored_from == ["persistent"] and "replica" in two.restored_from
