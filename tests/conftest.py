"""Shared pytest configuration."""

from __future__ import annotations

import warnings

import pytest
from helpers.samples import copy_ckpt, sample_state, save

#: The store fixtures (moto, SeaweedFS, FUSE mounts): one definition, so one server per session.
pytest_plugins = ["helpers.store_fixtures"]

# Single-process dcp.save/load warn that no process group exists; that is the point of those tests.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@pytest.fixture
def ckpt_dir(tmp_path):
    """A checkpoint location that does not exist yet."""
    return tmp_path / "ckpt"


@pytest.fixture(scope="session")
def sample_ckpt(tmp_path_factory):
    """(path, state) of a committed sample checkpoint for the tools' and CLI tests.

    Read-only: copy it (``ckpt``) before changing it. Created only when a test asks for it.
    """
    path = tmp_path_factory.mktemp("sample") / "step_00000100"
    sd = save(path, sample_state(), metadata={"step": 100})
    return path, sd


@pytest.fixture
def ckpt(sample_ckpt, tmp_path):
    """A private copy of the sample checkpoint (free to damage)."""
    return copy_ckpt(sample_ckpt[0], tmp_path / "step_00000100")
