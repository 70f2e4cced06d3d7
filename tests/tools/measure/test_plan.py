"""The goodput model against closed forms and a brute-force optimum."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from goodput_ckpt.tools.measure._bench_report import BenchReport, MethodResult
from goodput_ckpt.tools.measure.plan import (
    PlanInputs,
    goodput,
    inputs_from_bench,
    mtbf_from_fleet,
    optimal_interval,
    plan,
)


def test_young_daly_closed_forms():
    assert optimal_interval(60, 3 * 3600) == pytest.approx(
        math.sqrt(2 * 60 * 10800) * (1 + math.sqrt(60 / 21600) / 3 + (60 / 21600) / 9) - 60
    )
    assert optimal_interval(10_000, 1_000) == 1_000  # stall >= 2M: checkpoint once per MTBF
    assert optimal_interval(0, 1_000) == 0.0


def test_optimum_is_near_the_true_maximum_of_the_model():
    p = PlanInputs(stall=30, mtbf=4 * 3600, restore=120, restart=300, persist=60)
    result = plan(p)
    grid = [10 * i for i in range(1, 2000)]
    best = max(grid, key=lambda t: goodput(t, p))
    # Daly's first/higher-order optimum is within a few percent of the model's true maximum,
    # and the goodput there is within 0.05 percentage points of the best.
    assert abs(result.optimal_interval - best) / best < 0.05
    assert goodput(best, p) - result.goodput_at_optimum < 5e-4
    assert result.young_interval == pytest.approx(math.sqrt(2 * 30 * 4 * 3600))


def test_current_interval_and_sensitivities():
    p = PlanInputs(stall=20, mtbf=2 * 3600, restore=60, restart=120, current_interval=3600)
    result = plan(p)
    assert result.goodput_at_current is not None
    assert result.goodput_at_current < result.goodput_at_optimum
    s = result.sensitivity
    assert s["stall"] < 0 and s["restore"] < 0 and s["restart"] < 0  # doubling a cost hurts
    assert s["mtbf"] > 0  # doubling the MTBF helps
    assert s["persist"] == 0.0  # zero input: nothing to double


def test_goodput_formula_and_bounds():
    p = PlanInputs(stall=10, mtbf=1000, restore=5, restart=5)
    tau = 100
    assert goodput(tau, p) == pytest.approx(100 / 110 * (1 - (10 + 55) / 1000))
    assert goodput(10_000, p) == 0.0  # clipped: failures eat everything
    assert mtbf_from_fleet(1000, 0.001) == pytest.approx(3600.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(stall=-1, mtbf=10),
        dict(stall=1, mtbf=0),
        dict(stall=1, mtbf=float("inf")),
        dict(stall=1, mtbf=10, current_interval=0),
    ],
)
def test_bad_inputs(kwargs):
    with pytest.raises(ValueError):
        PlanInputs(**kwargs)


def _bench_doc(torch_reason: str | None = None) -> dict:
    """A bench report with known samples (three repeats) for the goodput method."""
    ours = MethodResult(
        "goodput",
        "CheckpointWriter",
        "CheckpointReader",
        1 << 30,
        stall_s=[0.1, 0.3, 0.2],
        async_total_s=[1.0, 1.5, 1.1],
        load_s=[2.0, 4.0, 3.0],
        save_s=[1.0, 1.0, 1.0],
    )
    theirs = MethodResult("torch", "FileSystemWriter", "FileSystemReader", 1 << 30, reason=torch_reason)
    return BenchReport(
        uri="/data",
        root="/data/goodput-bench-x",
        backend="local",
        size_bytes=1 << 30,
        requested_bytes=1 << 30,
        tensors=600,
        repeats=3,
        seed=0,
        thread_count=None,
        torch_thread_count=None,
        cold_cache=True,
        host={},
        methods=[ours, theirs],
    ).to_json()


def test_inputs_from_bench_takes_medians(tmp_path):
    m = inputs_from_bench(_bench_doc())
    assert (m.stall, m.restore, m.method, m.size_bytes, m.backend) == (0.2, 3.0, "goodput", 1 << 30, "local")
    assert m.persist == pytest.approx(0.9)  # median of async_total - stall per repeat: 0.9, 1.2, 0.9
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_bench_doc()))
    assert inputs_from_bench(path) == m and inputs_from_bench(str(path)) == m


def test_inputs_from_bench_refuses_what_it_cannot_use(tmp_path):
    with pytest.raises(ValueError, match="no figures for 'torch': n/a: no s3fs"):
        inputs_from_bench(_bench_doc(torch_reason="n/a: no s3fs"), method="torch")
    with pytest.raises(ValueError, match="no method 'other'"):
        inputs_from_bench(_bench_doc(), method="other")
    with pytest.raises(ValueError, match="not a goodput-ckpt bench report"):
        inputs_from_bench({"stall": 1})
    with pytest.raises(ValueError, match="cannot read the bench report"):
        inputs_from_bench(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the bench report"):
        inputs_from_bench(tmp_path / "bad.json")


@pytest.mark.parametrize("reader", ["inputs_from_bench", "inputs_from_timeline"])
def test_plan_from_a_report_needs_no_torch(tmp_path, reader):
    """The model and the readers of bench reports and timelines load no torch (plan is
    arithmetic on a file)."""
    path = tmp_path / "report"
    if reader == "inputs_from_bench":
        path.write_text(json.dumps(_bench_doc()))
    else:
        _timeline(path, [_save(1, 0, 0.1, 1.0)])
    code = f"import sys; from goodput_ckpt.tools.measure.plan import {reader} as f; f({str(path)!r}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _timeline(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _save(step, rank, stall, durable, *, ok=True, asynchronous=True):
    return {
        "event": "save",
        "step": step,
        "rank": rank,
        "time": 1000.0 + step,
        "async": asynchronous,
        "stall_s": stall,
        "write_s": durable,
        "durable_s": durable,
        "bytes": 100,
        "ok": ok,
    }


def test_inputs_from_timeline_take_medians_of_the_slowest_rank(tmp_path):
    from goodput_ckpt.tools.measure.plan import inputs_from_timeline

    records = [_save(s, r, 0.01 * (s + 1) * (r + 1), 0.5 + s + r) for s in range(3) for r in range(2)]
    records.append(_save(9, 0, 99.0, 99.0, ok=False))  # a failed save counts for nothing
    records += [
        {"event": "restore", "step": 2, "rank": r, "time": 2000.0 + r, "seconds": 3.0 + r, "ok": True} for r in range(2)
    ]
    records += [{"event": "restore", "step": 2, "rank": 0, "time": 9000.0, "seconds": 5.0, "ok": True}]  # a later job
    m = inputs_from_timeline(_timeline(tmp_path / "t.jsonl", records))
    assert m.stall == pytest.approx(0.04)  # per step: 0.02, 0.04, 0.06
    assert m.persist == pytest.approx(2.5)  # per step: 1.5, 2.5, 3.5
    assert m.restore == pytest.approx(4.5)  # restores: max(3, 4) = 4 and 5
    assert m.size_bytes == 200 and m.method == "median of 3 saves"


def test_inputs_from_timeline_of_synchronous_saves_have_no_persist_time(tmp_path):
    from goodput_ckpt.tools.measure.plan import inputs_from_timeline

    m = inputs_from_timeline(_timeline(tmp_path / "t.jsonl", [_save(1, 0, 2.0, 2.0, asynchronous=False)]))
    assert (m.stall, m.persist, m.restore) == (2.0, 0.0, 0.0)


def test_inputs_from_timeline_refuse_a_run_without_saves(tmp_path):
    from goodput_ckpt.tools.measure.plan import inputs_from_timeline

    with pytest.raises(ValueError, match="no successful save"):
        inputs_from_timeline(_timeline(tmp_path / "t.jsonl", [_save(1, 0, 1.0, 1.0, ok=False)]))
    with pytest.raises(ValueError, match="cannot read the timeline"):
        inputs_from_timeline(tmp_path / "missing.jsonl")
