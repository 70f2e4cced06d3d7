"""Fixtures of the reliability suite: the S3 servers, fault proxy and FUSE mounts of the store
tests (tests/storage/conftest.py, loaded here rather than copied), and a fork server.

The server fixtures are session-scoped and start only when a test asks for one. Loaded a second
time here, they are separate fixture definitions from those of tests/storage: a session that
runs both folders starts each server once per folder.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_TESTS))  # _s3, _volume, _volume_fixtures
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers of this folder

_spec = importlib.util.spec_from_file_location("_storage_fixtures", _TESTS / "storage" / "conftest.py")
_storage = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _storage  # dataclasses look their module up there
_spec.loader.exec_module(_storage)

s3_environ = _storage.s3_environ
moto_server = _storage.moto_server
seaweed_server = _storage.seaweed_server
moto = _storage.moto
seaweed = _storage.seaweed
rclone_volume = _storage.rclone_volume


@pytest.fixture(scope="session")
def forker(tmp_path_factory, s3_environ):
    """A fork server (``_forker.Forker``) for saving processes killed by the tests."""
    from _forker import Forker

    f = Forker(env=s3_environ, log=tmp_path_factory.mktemp("forker") / "zygote.log")
    yield f
    f.stop()
