"""Fixtures of the reliability suite: a fork server. The S3 servers, fault proxy and FUSE mounts
are the shared store fixtures (tests/helpers/store_fixtures.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def forker(tmp_path_factory, s3_environ):
    """A fork server (``_forker.Forker``) for saving processes killed by the tests."""
    from _forker import Forker

    f = Forker(env=s3_environ, log=tmp_path_factory.mktemp("forker") / "zygote.log")
    yield f
    f.stop()
