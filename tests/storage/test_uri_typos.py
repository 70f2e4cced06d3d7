"""A string that looks like a URL but does not parse as one is refused, naming the spelling it
probably meant (issue 32): ``CheckpointManager("s3:/bucket/run")`` used to write to
``./s3:/bucket/run`` on local disk. Local paths with a colon keep working."""

from __future__ import annotations

import io

import pytest

from goodput_ckpt import CheckpointManager, CheckpointReader, CheckpointWriter
from goodput_ckpt.cli import EXIT_USAGE, main
from goodput_ckpt.storage import FsspecStore, LocalStore, S3Store, is_supported_uri, open_store

TYPOS = {
    "s3:/bucket/run": "s3://bucket/run",
    "s3:bucket/run": "s3://bucket/run",
    "gs:/b/p": "gs://b/p",
    "file:/tmp/run": "file:///tmp/run",
    "memory:/run": "memory://run",
    "nosuchscheme:/host/x": "nosuchscheme://host/x",
}


@pytest.mark.parametrize("typo", sorted(TYPOS))
def test_url_typos_are_refused_with_the_spelling_meant(typo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    meant = TYPOS[typo]
    for open_it in (open_store, CheckpointWriter, CheckpointReader, CheckpointManager):
        with pytest.raises(ValueError, match=f"did you mean '{meant}'"):
            open_it(typo)
    assert not is_supported_uri(typo)
    assert not list(tmp_path.iterdir())  # nothing was created on local disk


def test_unknown_scheme_typo_also_offers_the_local_spelling():
    with pytest.raises(ValueError, match=r"'nosuchscheme://x', or './nosuchscheme:/x' for a local path"):
        open_store("nosuchscheme:/x")


def test_typo_message_hides_credentials():
    with pytest.raises(ValueError) as info:
        open_store("s3:/user:s3cr3t@bucket/run")
    assert "s3cr3t" not in str(info.value)


@pytest.mark.parametrize("path", ["C:/ckpt", "run:3", "data:v2", "./s3:/bucket", "a:b/c"])
def test_local_paths_with_a_colon_keep_working(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert isinstance(open_store(path), LocalStore)


def test_real_urls_keep_working():
    assert isinstance(open_store("s3://bucket/run"), S3Store)
    assert isinstance(open_store("memory://run"), FsspecStore)
    assert isinstance(open_store("file:///tmp/run"), LocalStore)


def test_cli_refuses_a_typo_as_a_usage_error():
    err = io.StringIO()
    code = main(["ls", "s3:/bucket/run"], stdout=io.StringIO(), stderr=err)
    assert code == EXIT_USAGE
    assert "s3://bucket/run" in err.getvalue() and "Traceback" not in err.getvalue()
