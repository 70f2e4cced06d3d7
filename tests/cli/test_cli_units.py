"""Rates and times in the unit their size calls for (issue 35, item 7): a 128-byte conversion
printed "0.00 GB/s"."""

from __future__ import annotations

import io
import re

import torch

from goodput_ckpt.cli import main
from goodput_ckpt.cli._output import human_rate, human_seconds


def test_human_rate_and_seconds():
    assert human_rate(128, 0.01) == "12.5 KiB/s"
    assert human_rate(100, 1.0) == "100 B/s"
    assert human_rate(3 << 30, 2.0) == "1.5 GiB/s"
    assert human_rate(5, 0.0) == "-"
    assert human_seconds(0.0123) == "12 ms" and human_seconds(2.5) == "2.50 s"


def test_small_conversions_reshards_and_verifies_print_a_readable_rate(tmp_path):
    torch.save({"w": torch.arange(32.0)}, tmp_path / "a.pt")
    lines = []
    for argv in (
        ["convert", tmp_path / "a.pt", tmp_path / "g", "--to", "goodput"],
        ["convert", tmp_path / "g", tmp_path / "b.pt", "--to", "torch"],
        ["reshard", tmp_path / "g", tmp_path / "r", "--world-size", "2"],
        ["verify", tmp_path / "r"],
    ):
        out = io.StringIO()
        assert main([str(a) for a in argv], stdout=out, stderr=io.StringIO()) == 0
        lines.append(out.getvalue().splitlines()[0])
    for line in lines:
        assert "0.00 GB/s" not in line and "GB/s" not in line, line
        assert re.search(r"\((\d+ B|[\d.]+ [KMGT]iB)/s\)", line), line
