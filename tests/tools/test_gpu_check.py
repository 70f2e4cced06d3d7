"""tools/gpu-check and benchmarks/gpu_check.py: its device-agnostic checks, run on CPU here.

The checks take the device as a parameter; on CPU they must all pass (the same save/restore,
staging and one-rank round trip a GPU machine runs on CUDA tensors). The stall figure is printed,
never asserted. The CUDA variant runs only where a GPU is (``pytest -m cuda``, what gpu-check runs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def test_checks_pass_on_cpu(tmp_path):
    lines: list[str] = []
    results = gpu_check.run_checks(torch.device("cpu"), tmp_path, stall_layers=2, repeats=1, out=lines.append)
    assert set(results) == {"save-restore", "staging", "dist", "stall"}
    assert all(v.startswith("ok: ") for v in results.values()), results
    assert "pinned=False" in results["staging"] and "gloo" in results["dist"]
    assert lines == [f"gpu-check: {k}: {v}" for k, v in results.items()]


def test_a_failed_check_is_reported_not_raised(tmp_path, monkeypatch):
    """One broken check fails the summary (exit 1) while the others still run and report."""

    def broken(device, scratch, layers=4):
        raise AssertionError("save-restore: the restored state differs (values or devices)")

    monkeypatch.setattr(gpu_check, "check_save_restore", broken)
    code = gpu_check.main(["--device", "cpu", "--no-tests", "--repeats", "1", "--stall-layers", "2"])
    assert code == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the checks run instead")
def test_script_without_gpu_says_skipped_and_exits_0():
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run([str(ROOT / "tools" / "gpu-check")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu-check: skipped: no GPU")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checks_pass_on_cuda(tmp_path):
    results = gpu_check.run_checks(torch.device("cuda"), tmp_path, stall_layers=8, repeats=2)
    assert all(v.startswith("ok: ") for v in results.values()), results
    assert "pinned=True" in results["staging"] and "nccl" in results["dist"]
    assert "CUDA generator restored" in results["save-restore"]
