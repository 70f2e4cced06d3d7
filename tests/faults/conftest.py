"""Fixtures of the reliability suite: a fork server. The S3 servers, fault proxy and FUSE mounts
are the shared store fixtures (tests/_store_fixtures.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers of this folder


@pytest.fixture(scope="session")
def forker(tmp_path_factory, s3_environ):
    """A fork server (``_forker.Forker``) for saving processes killed by the tests."""
    from _forker import Forker

    f = Forker(env=s3_environ, log=tmp_path_factory.mktemp("forker") / "zygote.log")
    yield f
    f.stop()
