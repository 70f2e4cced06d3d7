"""S3 faults that tests/storage/test_s3_faults.py leaves out, through the same loopback proxy.

That file covers, by count: 503 SlowDown, 500, resets before and after the server did the work,
stalled responses and bodies, and bodies cut short, each retried to success; at 3% each on every
request, by probability; and persistent 503/500/stall/reset on the upload and the commit and
reset/stall on reads, each failing cleanly. Added here:

- a **request body truncated** on its way (``truncate_request``, see ``_truncating_proxy``):
  retried to success where the server checks the body's CRC-32 (SeaweedFS), and, where it does
  not (moto), caught by the size check after each PUT (sent again) or completion (the save
  fails cleanly): never committed short;
- **persistent** faults not covered there: the answer to every part lost after the server
  stored it, a stalled commit, a stalled multipart completion, every read body cut short, and
  a persistently truncated body; each must fail with a ``CheckpointError`` that names the
  object and the cause, after a bounded number of attempts (counted at the proxy), leaving no
  manifest, no open multipart upload and no completed data object;
- **random faults by probability** at a high rate (every kind of fault, stalls included, on
  every request) with a small retry budget: each trial's save either commits a checkpoint that
  loads exactly, or fails cleanly as above; never anything in between.
"""

from __future__ import annotations

import pytest
import torch
from _reliability import fault_trials, record
from _truncating_proxy import TruncatingProxy
from helpers.errors import checkpoint_error
from helpers.s3_roundtrip import load, s3_state, save
from helpers.trees import assert_tree_equal

from goodput_ckpt import CheckpointError, CheckpointNotFoundError, CheckpointReader, IncompleteCheckpointError
from goodput_ckpt.errors import find_checkpoint_error
from goodput_ckpt.format.manifest import MANIFEST_NAME

#: 1 s without a byte is a stall; few attempts and a short budget, so failures come quickly.
BUDGET = {"read_timeout": 1.0, "connect_timeout": 1.0, "max_attempts": 4, "retry_time_limit": 3.0}
#: A small state: one 2-part data file (5 MiB parts) and a few small items.
SMALL = {"w": torch.arange(7 << 18, dtype=torch.float32), "b": torch.arange(300, dtype=torch.int64), "step": 3}


def _via(target, proxy):
    return type(target)(target.server, proxy.url, target.bucket)


@pytest.fixture
def proxies():
    """``start(server)``: a TruncatingProxy in front of ``server``, stopped after the test."""
    started = []

    def start(server) -> TruncatingProxy:
        p = TruncatingProxy(server.url)
        p.stall_s = 5.0
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


@pytest.fixture
def tproxy_moto(moto_server, proxies):
    return proxies(moto_server)


@pytest.fixture
def tproxy_seaweed(seaweed_server, proxies):
    return proxies(seaweed_server)


def assert_nothing_committed(target, prefix: str, *, data_written: bool) -> None:
    """No manifest and no open multipart upload under ``prefix``; no data object either unless
    the data was all written (a failed commit leaves it, visibly incomplete, for the next save
    at the location to clean up)."""
    keys = target.keys(f"{prefix}/")
    assert not any(k.endswith(MANIFEST_NAME) for k in keys) and (data_written or keys == []), keys
    assert [k for k in target.open_uploads() if k.startswith(f"{prefix}/")] == []
    with pytest.raises((CheckpointNotFoundError, IncompleteCheckpointError)):
        CheckpointReader(target.uri(prefix), **target.options()).read_metadata()


# -- truncated request bodies -----------------------------------------------------------------------
@pytest.mark.parametrize("op", ["UploadPart", "PutObject"])
def test_truncated_upload_body_is_sent_again(seaweed, tproxy_seaweed, op):
    """SeaweedFS checks the CRC-32 the client sends with every part and object (BadDigest): the
    short body is refused, sent again whole, and the checkpoint is exact."""
    rule = tproxy_seaweed.add("truncate_request", op=op, key_contains=".bin", times=1)
    state = s3_state(3) if op == "UploadPart" else {"w": torch.arange(1 << 18, dtype=torch.float32)}
    save(state, _via(seaweed, tproxy_seaweed), "cut", **{**BUDGET, "read_timeout": 10.0, "retry_time_limit": 30.0})
    assert rule.fired == 1
    assert_tree_equal(load(state, seaweed, "cut"), state)
    record(
        f"S3: request body truncated once ({op})",
        "s3 (seaweedfs)",
        trials=1,
        faults_injected=1,
        detected_or_recovered=1,
        data_lost=0,
    )


@pytest.mark.parametrize("op", ["PutObject", "UploadPart"])
def test_truncated_upload_body_never_completes_a_short_object(moto, tproxy_moto, op):
    """moto checks no body checksum: the client's size check after the PUT (sent again) or the
    completion (the save fails cleanly) is what keeps a short object out of a checkpoint."""
    tproxy_moto.add("truncate_request", op=op, key_contains=".bin", times=1)
    state = s3_state(3) if op == "UploadPart" else {"w": torch.arange(1 << 18, dtype=torch.float32)}
    try:
        save(state, _via(moto, tproxy_moto), "short", **BUDGET)
    except BaseException as e:  # noqa: BLE001 - a clean failure is fine too
        assert isinstance(find_checkpoint_error(e), CheckpointError), e
        assert not any(k.endswith(MANIFEST_NAME) for k in moto.keys("short/"))
        return
    assert_tree_equal(load(state, moto, "short"), state)  # committed: then every byte must be there


# -- persistent faults ---------------------------------------------------------------------------------
PERSISTENT = {
    # name: (action, operation, key part, cause in the message)
    "part answers lost": ("reset_after", "UploadPart", ".bin", "Connection|connection|closed"),
    "completion stalls": ("stall", "CompleteMultipartUpload", ".bin", "ReadTimeout|timed out"),
    "commit stalls": ("stall", "PutObject", MANIFEST_NAME, "ReadTimeout|timed out"),
    "part bodies truncated": ("truncate_request", "UploadPart", ".bin", "BadDigest"),
    "read bodies cut short": ("cut_body", "GetObject", ".bin", "ended|short|IncompleteRead|Connection|connection"),
}


@pytest.mark.parametrize("case", sorted(PERSISTENT))
def test_persistent_fault_fails_cleanly_within_the_budget(case, seaweed, tproxy_seaweed):
    import re

    action, op, part, cause = PERSISTENT[case]
    via = _via(seaweed, tproxy_seaweed)
    prefix = "p-" + case.replace(" ", "-")
    reading = op == "GetObject"
    if reading:
        save(SMALL, seaweed, prefix)
    tproxy_seaweed.add(action, op=op, key_contains=part)
    with pytest.raises(BaseException) as info:
        if reading:
            load(SMALL, via, prefix, **BUDGET)
        else:
            save(SMALL, via, prefix, **BUDGET)
    err = checkpoint_error(info)
    assert f"/{prefix}/" in str(err) and part in (err.path or "") + str(err), err
    assert re.search(cause, str(err)), str(err)
    faulted = [(a, k) for a, o, k in tproxy_seaweed.log.faults]
    per_key = max(faulted.count(x) for x in set(faulted))
    assert per_key <= BUDGET["max_attempts"] * 2, f"{per_key} attempts on one object: not bounded by the budget"
    if reading:
        tproxy_seaweed.clear()
        assert_tree_equal(load(SMALL, via, prefix), SMALL)  # nothing was damaged by the failed reads
    else:
        assert_nothing_committed(seaweed, prefix, data_written=part == MANIFEST_NAME)
    record(
        f"S3 persistent fault: {case}",
        "s3 (seaweedfs)",
        trials=1,
        faults_injected=len(faulted),
        detected_or_recovered=1,
        data_lost=0,
        attempts_on_one_object=per_key,
    )


# -- random faults by probability ------------------------------------------------------------------------
ACTIONS = ("503", "500", "reset", "reset_after", "stall", "stall_body", "cut_body", "truncate_request")


@pytest.mark.slow  # 20-40 s: stalls cost a read timeout each
def test_random_faults_at_a_high_rate(seaweed, tproxy_seaweed):
    """Each trial: every request meets one of eight faults with probability 3% each (about 22%
    in all), a small retry budget. The save commits and loads exactly (also through the faults),
    or fails cleanly; the counts of both go to the report."""
    trials = fault_trials(8)
    via = _via(seaweed, tproxy_seaweed)
    committed = failed = injected = 0
    problems = []
    for trial in range(trials):
        tproxy_seaweed.clear()
        tproxy_seaweed._server.rng.seed(trial)
        for action in ACTIONS:
            tproxy_seaweed.add(action, probability=0.03)
        state = s3_state(10 + trial)
        prefix = f"chaos{trial}"
        try:
            save(state, via, prefix, **BUDGET)
        except BaseException as e:  # noqa: BLE001 - classified below
            injected += len(tproxy_seaweed.log.faults)
            err = find_checkpoint_error(e)
            tproxy_seaweed.clear()
            if err is None or any(k.endswith(MANIFEST_NAME) for k in seaweed.keys(f"{prefix}/")):
                problems.append(f"trial {trial}: unclean failure {e!r}")
            if [k for k in seaweed.open_uploads() if k.startswith(f"{prefix}/")]:
                problems.append(f"trial {trial}: multipart uploads left open")
            failed += 1
            continue
        try:
            got = load(state, via, prefix, **BUDGET)
            assert_tree_equal(got, state)
        except AssertionError:
            problems.append(f"trial {trial}: a load through the faults returned wrong values")
        except BaseException as e:  # noqa: BLE001 - a clean read failure is acceptable
            if find_checkpoint_error(e) is None:
                problems.append(f"trial {trial}: unclean read failure {e!r}")
        injected += len(tproxy_seaweed.log.faults)
        tproxy_seaweed.clear()
        assert_tree_equal(load(state, seaweed, prefix), state)
        committed += 1
    record(
        "S3 random faults by probability (8 kinds, ~22% of requests)",
        "s3 (seaweedfs)",
        trials=trials,
        faults_injected=injected,
        detected_or_recovered=trials - len(problems),
        data_lost=len(problems),
        committed=committed,
        failed_cleanly=failed,
    )
    assert not problems, problems
    assert injected > trials, "the faults never fired"
