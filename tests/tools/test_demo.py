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

from goodput_ckpt.tools.demo import MARKER, DemoConfig, _compare, _prepare, run_demo

pytestmark = pytest.mark.multiproc

SMALL = ["--steps", "24", "--save-every", "5", "--width", "64"]


def _demo_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "goodput_ckpt.tools._demo_job" in line]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("demo") / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "goodput_ckpt.cli", "demo", "--dir", str(work), *SMALL, "--kill-at", "12", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
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
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in ("RESUME OK", "KILLED", "RESTARTED", "all verified", "GOODPUT", "With synchronous checkpoints", "lost work"):
        assert text in proc.stdout
    assert "==>" not in proc.stderr


def test_a_rerun_clears_its_own_directory_but_refuses_others(tmp_path):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "precious.txt").write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "goodput_ckpt.cli", "demo", "--dir", str(other), *SMALL],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
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
