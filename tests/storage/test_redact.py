"""Credentials in a URL reach no ``store.uri``, repr or error message, on any backend's parse path
(before: ``s3://KEY:SECRET@bucket`` and ``http://user:pw@host`` were echoed in errors and ``--json``)."""

from __future__ import annotations

import pytest

from goodput_ckpt import CheckpointError
from goodput_ckpt.storage import is_supported_uri, open_store, redact
from goodput_ckpt.storage.s3 import parse_s3_uri

SECRET = "Sup3rSecretValue"


def _no_secret(*texts: object) -> None:
    for text in texts:
        assert SECRET not in str(text) and SECRET not in repr(text)


@pytest.mark.parametrize(
    "uri",
    [
        f"s3://AKIDEXAMPLE:{SECRET}@bucket/ckpt",
        f"s3://AKIDEXAMPLE:ab/{SECRET}@bucket/ckpt",  # AWS secret keys may hold a "/"
        f"s3://{SECRET}@bucket/ckpt",
        f"bogus://user:{SECRET}@host/ckpt",
    ],
)
def test_refused_uris_do_not_echo_credentials(uri):
    assert not is_supported_uri(uri)
    with pytest.raises((ValueError, CheckpointError)) as info:
        open_store(uri)
    _no_secret(info.value, info.value.args)
    if uri.startswith("s3://"):
        with pytest.raises(ValueError) as info:
            parse_s3_uri(uri)
        _no_secret(info.value)


@pytest.mark.parametrize(
    "uri",
    [
        f"http://user:{SECRET}@127.0.0.1:9/ckpt",
        f"https://user:{SECRET}@127.0.0.1:9/ckpt",
        f"ftp://user:{SECRET}@127.0.0.1:9/ckpt",
        f"memory://user:{SECRET}@host/ckpt",
        f"file://user:{SECRET}@host/ckpt",
    ],
)
def test_fsspec_stores_keep_credentials_out_of_uri_repr_and_errors(uri):
    try:
        store = open_store(uri)
    except ValueError as e:  # the protocol's package is not installed (http:// without aiohttp)
        assert "not installed" in str(e)
        _no_secret(e)
        return
    _no_secret(store.uri, store)
    assert "://***@" in store.uri
    for op in (
        store.list,
        lambda: store.read_small("manifest.json"),
        lambda: store.open_source("x").read_into(0, [bytearray(1)]),
    ):
        try:
            op()
        except CheckpointError as e:  # no server there, or a missing extra package
            _no_secret(e, e.path)


def test_redact_masks_user_info_only():
    assert redact(f"http://u:{SECRET}@h/x and s3://b/k@v") == "http://***@h/x and s3://b/k@v"
    assert redact(f"s3://K:pa@{SECRET}@bucket/x") == "s3://***@bucket/x"
