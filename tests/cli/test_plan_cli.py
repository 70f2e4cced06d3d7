"""``goodput-ckpt plan`` end to end through the console entry point."""

from __future__ import annotations

import io
import json

import pytest

from goodput_ckpt.cli import main
from goodput_ckpt.cli.plan import parse_duration


def _run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_plan_text_and_json():
    code, out, _ = _run(
        "plan", "--stall", "2s", "--restore", "90s", "--restart", "5m", "--mtbf", "3h", "--current-interval", "1h"
    )
    assert code == 0 and "optimal (Daly)" in out and "current" in out
    code, out, _ = _run("plan", "--stall", "2s", "--gpus", "4096", "--gpu-failures-per-hour", "2e-5", "--json")
    doc = json.loads(out)
    assert code == 0
    assert doc["inputs"]["mtbf"] == pytest.approx(3600 / (4096 * 2e-5))
    assert doc["optimal_interval"] < doc["young_interval"]
    assert set(doc["sensitivity"]) == {"stall", "persist", "restore", "restart", "mtbf"}


@pytest.mark.parametrize(
    "argv",
    [
        ("plan", "--stall", "x", "--mtbf", "3h"),
        ("plan", "--stall", "1s"),
        ("plan", "--stall", "1s", "--gpus", "8"),
        ("plan", "--stall", "1s", "--mtbf", "0s"),
        ("plan", "--mtbf", "3h"),  # no --stall and no --from-bench
        ("plan", "--from-bench", "/nonexistent/bench.json", "--mtbf", "3h"),
    ],
)
def test_plan_usage_errors_exit_2_without_traceback(argv):
    code, out, err = _run(*argv)
    assert code == 2
    assert "Traceback" not in out + err


def test_parse_duration():
    assert parse_duration("90") == 90
    assert parse_duration("250ms") == 0.25
    assert parse_duration("1.5h") == 5400
    assert parse_duration("2d") == 172800


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    """The --json output of a real (small) `goodput-ckpt bench`, written to a file.

    ``--quiet 0``: the default waits up to 10 s before each timed step for an idle machine (a
    minute or more of this fixture on a shared one); the figures' values do not matter here.
    """
    where = tmp_path_factory.mktemp("bench")
    code, out, err = _run(
        "bench", str(where / "scratch"), "--size", "8MiB", "--repeats", "1", "--quiet", "0", "--json", "--no-progress"
    )
    assert code == 0, err
    path = where / "bench.json"
    path.write_text(out)
    return path, json.loads(out)


def test_plan_from_bench(bench_json):
    path, doc = bench_json
    ours = doc["methods"][0]
    code, out, _ = _run("plan", "--from-bench", str(path), "--mtbf", "3h", "--json")
    plan_doc = json.loads(out)
    assert code == 0
    assert plan_doc["inputs"]["stall"] == ours["median"]["stall_s"]
    assert plan_doc["inputs"]["restore"] == ours["median"]["load_s"]
    persist = ours["samples"]["async_total_s"][0] - ours["samples"]["stall_s"][0]
    assert plan_doc["inputs"]["persist"] == pytest.approx(persist)
    assert plan_doc["from_bench"]["method"] == "goodput" and plan_doc["from_bench"]["size_bytes"] == doc["size_bytes"]
    # Explicit flags override the measured figures; the others still come from the report.
    code, out, _ = _run(
        "plan", "--from-bench", str(path), "--mtbf", "3h", "--stall", "2s", "--restore", "90s", "--json"
    )
    inputs = json.loads(out)["inputs"]
    assert (inputs["stall"], inputs["restore"]) == (2.0, 90.0) and inputs["persist"] == pytest.approx(persist)
    code, out, _ = _run("plan", "--from-bench", str(path), "--mtbf", "3h", "--stall", "2s")
    assert code == 0 and out.startswith(f"from {path} (goodput, 8.0 MiB state on local): persist ")
    assert "restore" in out.splitlines()[0] and "stall" not in out.splitlines()[0] and "optimal (Daly)" in out


def test_plan_from_a_file_that_is_not_a_bench_report(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"stall": 1}))
    code, out, err = _run("plan", "--from-bench", str(path), "--mtbf", "3h")
    assert code == 2 and "not a goodput-ckpt bench report" in err and "Traceback" not in out + err


def test_plan_from_a_real_manager_timeline(tmp_path):
    import torch

    from goodput_ckpt import CheckpointManager

    model = torch.nn.Linear(32, 32)
    with CheckpointManager(tmp_path / "run") as mgr:
        for step in range(3):
            mgr.save(step, model=model)
        mgr.wait()
        mgr.restore(model=model)
        path = mgr.timeline_path
    code, out, err = _run("plan", "--from-timeline", path, "--mtbf", "3h", "--json")
    assert code == 0, err
    doc = json.loads(out)
    got = doc["from_timeline"]
    assert got["stall"] > 0 and got["persist"] > 0 and got["restore"] > 0 and got["method"] == "median of 3 saves"
    assert doc["inputs"]["stall"] == got["stall"]
    code, out, err = _run("plan", "--from-timeline", path, "--stall", "1s", "--mtbf", "3h")
    assert code == 0 and "from " in out and "stall" not in out.split("\n")[0].split(":")[1]
    code, _, err = _run("plan", "--from-timeline", path, "--from-bench", path, "--mtbf", "3h")
    assert code == 2 and "not both" in err and "Traceback" not in err


TWO_LEVEL = (
    "plan",
    "--local-stall",
    "2s",
    "--replicate",
    "8s",
    "--local-restore",
    "30s",
    "--persist-stall",
    "20s",
    "--persist",
    "3m",
    "--restore",
    "5m",
    "--restart",
    "4m",
    "--node-mtbf",
    "4h",
    "--job-mtbf",
    "3d",
)


def test_plan_two_levels_text_and_json():
    code, out, err = _run(*TWO_LEVEL)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["SCHEDULE", "LOCAL", "EVERY", "PERSIST_EVERY", "PERSISTENT", "EVERY", "GOODPUT"]
    assert lines[1].startswith("two levels (best)") and "one level (Daly)" in out and "gain over one level: +" in out
    code, out, _ = _run(*TWO_LEVEL, "--json")
    doc = json.loads(out)
    assert code == 0
    assert set(doc) == {
        "inputs",
        "local_interval",
        "persist_every",
        "persistent_period",
        "goodput",
        "bound",
        "one_level",
        "gain",
        "options",
        "from_bench",
    }
    assert doc["inputs"]["node_mtbf"] == 4 * 3600 and doc["inputs"]["persist"] == 180
    assert isinstance(doc["persist_every"], int) and doc["persist_every"] > 1
    assert doc["goodput"] > doc["one_level"]["goodput_at_optimum"]
    assert doc["gain"] == pytest.approx(100 * (doc["goodput"] - doc["one_level"]["goodput_at_optimum"]), abs=1e-5)
    assert doc["one_level"]["inputs"]["stall"] == 22  # the same save, local stall and persistent stall
    assert {o["persist_every"] for o in doc["options"]} >= {1, doc["persist_every"] + 1}


def test_plan_two_levels_without_node_failures():
    code, out, _ = _run("plan", "--local-stall", "2s", "--node-mtbf", "inf", "--job-mtbf", "12h", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["inputs"]["node_mtbf"] is None and doc["persist_every"] == 1
    code, out, _ = _run("plan", "--local-stall", "2s", "--node-mtbf", "never", "--job-mtbf", "12h")
    assert code == 0 and "node MTBF never" in out


def test_plan_two_levels_from_bench(bench_json):
    path, doc = bench_json
    ours = doc["methods"][0]
    code, out, err = _run(
        "plan", "--from-bench", str(path), "--local-stall", "1s", "--node-mtbf", "4h", "--job-mtbf", "3d", "--json"
    )
    assert code == 0, err
    inputs = json.loads(out)["inputs"]
    assert (
        inputs["restore"] == ours["median"]["load_s"] and inputs["local_stall"] == 1.0
    )  # the persistent tier's figures
    code, out, _ = _run(
        "plan", "--from-bench", str(path), "--local-stall", "1s", "--node-mtbf", "4h", "--job-mtbf", "3d"
    )
    assert code == 0 and out.startswith(f"from {path} (goodput, 8.0 MiB state on local): persist ")


@pytest.mark.parametrize(
    "argv, message",
    [
        (("plan", "--local-stall", "1s", "--job-mtbf", "3d"), "needs --node-mtbf"),
        (("plan", "--node-mtbf", "4h", "--job-mtbf", "3d"), "needs --local-stall"),
        (("plan", "--local-stall", "1s", "--node-mtbf", "4h"), "needs --job-mtbf"),
        (
            ("plan", "--local-stall", "1s", "--node-mtbf", "4h", "--job-mtbf", "3d", "--mtbf", "3h"),
            "--mtbf: only for the one-level plan",
        ),
        (
            (
                "plan",
                "--local-stall",
                "1s",
                "--node-mtbf",
                "4h",
                "--job-mtbf",
                "3d",
                "--stall",
                "1s",
                "--current-interval",
                "1h",
            ),
            "--stall, --current-interval: only for the one-level plan",
        ),
        (("plan", "--local-stall", "1s", "--node-mtbf", "0s", "--job-mtbf", "3d"), "node_mtbf must be a positive"),
        (
            ("plan", "--local-stall", "1s", "--node-mtbf", "4h", "--job-mtbf", "3d", "--max-persist-every", "0"),
            "max_persist_every",
        ),
        (("plan", "--stall", "1s"), "give --mtbf, or --gpus"),
    ],
)
def test_plan_two_levels_bad_inputs_exit_2_with_a_message(argv, message):
    code, out, err = _run(*argv)
    assert code == 2 and message in err
    assert "Traceback" not in out + err
