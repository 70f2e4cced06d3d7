"""benchmarks/_plugin_bench.py: the summary bench_hf.py and bench_lightning.py share."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from _plugin_bench import summarize  # noqa: E402


def test_ratios_pair_the_samples_of_the_same_repeat():
    """Repeat 1 was disturbed for both methods: a per-repeat ratio keeps it a 2x, where a ratio
    of unpaired samples would not."""
    results = {
        "stock": [{"save_s": 1.0}, {"save_s": 10.0}, {"save_s": 2.0}],
        "ours": [{"save_s": 0.5}, {"save_s": 5.0}, {"save_s": 1.0}],
    }
    out = summarize(results, ["save_s"], {"ours": "stock"})
    assert out["stock"]["save_s"] == {"min": 1.0, "median": 2.0, "max": 10.0, "all": [1.0, 10.0, 2.0]}
    assert "vs" not in out["stock"]
    vs = out["ours"]["vs"]
    assert vs["baseline"] == "stock"
    assert vs["save_s"]["min"] == vs["save_s"]["median"] == vs["save_s"]["max"] == pytest.approx(2.0)


def test_a_method_without_a_baseline_is_summarized_alone():
    out = summarize({"a": [{"x_s": 1.0}] * 3, "b": [{"x_s": 2.0}] * 3}, ["x_s"], {})
    assert "vs" not in out["a"] and "vs" not in out["b"]
    assert out["b"]["x_s"]["median"] == 2.0
