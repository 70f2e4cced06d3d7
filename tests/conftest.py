"""Shared pytest configuration."""

from __future__ import annotations

import warnings

import pytest

# Single-process dcp.save/load warn that no process group exists; that is the point of those tests.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@pytest.fixture
def ckpt_dir(tmp_path):
    """A checkpoint location that does not exist yet."""
    return tmp_path / "ckpt"
