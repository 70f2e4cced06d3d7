"""Retention on S3 with objects no store call may touch (issue 33): a key such as
``ROOT/step_N/../../x``, planted with boto3 on a real (moto) server. Before the fix every
save's retention failed on it ("will retry"), and step N's data stayed forever; now such keys
are skipped with one warning and retention of everything else goes on."""

from __future__ import annotations

import logging

from helpers.records import empty_record

from goodput_ckpt.manager.retention import apply_retention, clean_before_restore, scan_steps
from goodput_ckpt.manager.step_layout import list_step_dirs
from goodput_ckpt.storage import open_store

PLANTED = ("root/step_00000001/../../x", "root/step_00000002/a//b", "root/step_00000002/./c")


def _steps(moto, steps):
    client = moto.client()
    for s in steps:
        for f in ("manifest.json", "rank00000-00.0123456789ab.bin"):
            body = empty_record() if f == "manifest.json" else b"data"  # a record retention can read
            client.put_object(Bucket=moto.bucket, Key=f"root/step_{s:08d}/{f}", Body=body)
    return client


def _warnings(caplog):
    return [
        r.getMessage() for r in caplog.records if r.name == "goodput_ckpt.retention" and r.levelno >= logging.WARNING
    ]


def test_unsafe_keys_are_skipped_with_one_warning_and_retention_goes_on(moto, caplog):
    client = _steps(moto, [1, 2, 3])
    for key in PLANTED + ("x",):  # "x" at the bucket's top: what the first key would name, normalized
        client.put_object(Bucket=moto.bucket, Key=key, Body=b"planted")
    root = open_store(moto.uri("root"), moto.options())
    skipped: list[str] = []
    assert sorted(list_step_dirs(root, skipped)) == [1, 2, 3]
    assert sorted(skipped) == sorted(k[len("root/") :] for k in PLANTED)

    caplog.set_level(logging.INFO, logger="goodput_ckpt.retention")
    apply_retention(root, committed=3, keep_last=1)
    assert moto.keys() == sorted(
        PLANTED + ("x", "root/step_00000003/manifest.json", "root/step_00000003/rank00000-00.0123456789ab.bin")
    )
    (warning,) = _warnings(caplog)  # one warning, naming the keys; none saying "will retry"
    assert "3 object(s)" in warning and "'step_00000001/../../x'" in warning and "retry" not in warning

    # The next saves: retention goes on, and the same keys are not warned about again.
    _steps(moto, [4, 5])
    apply_retention(root, committed=5, keep_last=1)
    assert scan_steps(root).complete == [5]
    assert len(_warnings(caplog)) == 1
    assert clean_before_restore(root, keep_last=1) == 5
    assert len(_warnings(caplog)) == 1
    assert set(PLANTED) | {"x"} <= set(moto.keys())
