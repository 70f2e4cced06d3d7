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
    code, out, _ = _run("plan", "--stall", "2s", "--restore", "90s", "--restart", "5m", "--mtbf", "3h", "--current-interval", "1h")
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
