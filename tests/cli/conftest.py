"""Fixtures for the tools' tests: one sample checkpoint per session, copied before damage."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # for _ckpt_samples

from _ckpt_samples import copy_ckpt, sample_state, save  # noqa: E402


@pytest.fixture(scope="session")
def sample_ckpt(tmp_path_factory):
    """(path, state) of a committed sample checkpoint. Read-only: copy it before changing it."""
    path = tmp_path_factory.mktemp("sample") / "step_00000100"
    sd = save(path, sample_state(), metadata={"step": 100})
    return path, sd


@pytest.fixture
def ckpt(sample_ckpt, tmp_path):
    """A private copy of the sample checkpoint (free to damage)."""
    return copy_ckpt(sample_ckpt[0], tmp_path / "step_00000100")
