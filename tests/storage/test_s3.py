"""The S3 store, and CheckpointWriter/CheckpointReader on ``s3://``, against real servers.

``s3`` runs a test on moto and on SeaweedFS; ``moto`` on moto alone (S3 semantics); ``proxy``
puts the fault proxy of ``tests/helpers/s3.py`` in front of moto (here only to count requests or to
answer like a server that echoes credentials). Fault injection proper is in test_s3_faults.py.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import threading

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.errors import checkpoint_error
from helpers.s3 import ACCESS_KEY, SECRET_KEY
from helpers.s3_roundtrip import CHUNK, MiB, load, s3_state, save
from helpers.trees import assert_tree_equal, zeros_like

from goodput_ckpt import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointReader,
    CheckpointWriter,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from goodput_ckpt.storage import S3Config, S3Store, is_supported_uri, open_store
from goodput_ckpt.storage.s3 import parse_s3_uri


# -- round trips ------------------------------------------------------------------------------
def test_round_trip(s3):
    state = s3_state()
    save(state, s3, "run/step_1")
    keys = s3.keys("run/step_1/")
    assert keys[0] == "run/step_1/manifest.json" and len(keys) == 2, keys  # one data file per rank
    assert s3.open_uploads() == []
    assert_tree_equal(load(state, s3, "run/step_1"), state)
    # A partial load reads only what it needs, with fewer threads.
    part = {"h": torch.zeros(40, 7, dtype=torch.bfloat16)}
    dcp.load(part, storage_reader=CheckpointReader(s3.uri("run/step_1"), thread_count=2, **s3.options()))
    assert torch.equal(part["h"], state["h"])


def test_existing_checkpoint_refused_then_overwritten(moto):
    save(s3_state(0), moto, "ckpt")
    with pytest.raises(BaseException) as info:
        save(s3_state(1), moto, "ckpt")
    assert isinstance(checkpoint_error(info), CheckpointExistsError)
    assert_tree_equal(load(s3_state(0), moto, "ckpt"), s3_state(0))
    old = moto.keys("ckpt/")
    save(s3_state(1), moto, "ckpt", overwrite=True)
    new = moto.keys("ckpt/")
    assert_tree_equal(load(s3_state(1), moto, "ckpt"), s3_state(1))
    assert len(new) == 2 and set(old) & set(new) == {"ckpt/manifest.json"}, "old data files are removed"
    assert moto.keys("ckpt2/") == [], "prefixes are directories: ckpt does not list ckpt2"


def test_chunk_size_below_s3_minimum_is_refused(moto, tmp_path):
    with pytest.raises(ValueError, match=r"at least 5242880 bytes"):
        CheckpointWriter(moto.uri("x"), chunk_size=1 * MiB, **moto.options())
    writer = CheckpointWriter(tmp_path / "local", chunk_size=1 * MiB)  # fine on local disk
    with pytest.raises(ValueError, match="too small"):
        writer.reset(moto.uri("x"))  # options are the writer's: none here, so the default endpoint
    with pytest.raises(ValueError, match="multiple of part_size"):
        open_store(moto.uri("x"), moto.options(part_size=6 * MiB)).open_sink("a.bin", part_size=8 * MiB)


def test_part_size_splits_chunks(moto, proxy):
    """part_size below the chunk: each chunk goes up as several parts."""
    target = type(moto)("moto", proxy.url, moto.bucket)
    state = s3_state()
    save(state, target, "split", chunk_size=10 * MiB, part_size=5 * MiB)
    size = next(
        o["Size"] for o in moto.client().list_objects_v2(Bucket=moto.bucket)["Contents"] if o["Key"].endswith(".bin")
    )
    assert proxy.count("UploadPart") == -(-size // (5 * MiB)) == 4
    assert_tree_equal(load(state, target, "split"), state)


def test_async_save_and_pickling(moto):
    state = s3_state(3)
    writer = CheckpointWriter(moto.uri("async"), chunk_size=CHUNK, **moto.options())
    writer.store.client()  # a live client and its pool must not travel
    clone = pickle.loads(pickle.dumps(writer))
    assert clone.store._client is None
    expected = {
        k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor) and v.dtype != torch.float8_e4m3fn
    }
    expected["step"] = state["step"]
    state = {k: state[k] for k in expected}
    fut = dcp.async_save(state, storage_writer=clone)
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.add_(1) if v.dtype != torch.bool else v.logical_not_()
    state["step"] = -1
    fut.result(timeout=120)
    assert_tree_equal(load(expected, moto, "async"), expected)


# -- the store ----------------------------------------------------------------------------------
def test_sink_parts_in_any_order_from_threads(moto, proxy):
    store = open_store(moto.uri("raw"), type(moto)("moto", proxy.url, moto.bucket).options())
    data = bytes(range(256)) * (3 * CHUNK // 256) + b"tail" * 1000  # 3 full parts and a short one
    sink = store.open_sink("data.bin", part_size=CHUNK)
    offsets = list(range(0, len(data), CHUNK))
    threads = [
        threading.Thread(target=sink.write_at, args=(o, [data[o : o + 100], memoryview(data)[o + 100 : o + CHUNK]]))
        for o in reversed(offsets)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sink.close()
    sink.close()  # idempotent
    assert proxy.count("UploadPart") == 4 and proxy.count("CreateMultipartUpload") == 1
    assert store.size("data.bin") == len(data)
    src = store.open_source("data.bin")
    a, b = bytearray(7), bytearray(CHUNK)  # a range that straddles parts and buffers
    src.read_into(CHUNK - 3, [a, b])
    assert bytes(a + b) == data[CHUNK - 3 : 2 * CHUNK + 4]
    with pytest.raises(IncompleteCheckpointError) as info:
        src.read_into(len(data) - 10, [bytearray(20)])
    assert info.value.byte_range == (len(data) - 10, len(data) + 10)
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        store.open_source("nope.bin").read_into(0, [bytearray(1)])

    small = store.open_sink("small.bin", part_size=CHUNK)  # one short chunk: a single PUT
    small.write_at(0, [b"abc", b"def"])
    small.close()
    empty = store.open_sink("empty.bin", part_size=CHUNK)
    empty.close()
    assert proxy.count("CreateMultipartUpload") == 1
    assert store.read_small("small.bin") == b"abcdef" and store.read_small("empty.bin") == b""
    assert store.list() == ["data.bin", "empty.bin", "small.bin"]
    small.abort()  # after close: removes the object
    store.delete("empty.bin")
    store.delete("never-existed.bin")
    assert store.list() == ["data.bin"] and store.size("small.bin") is None and store.read_small("x") is None
    with pytest.raises(CheckpointError, match="multiple"):
        store.open_sink("bad.bin", part_size=CHUNK).write_at(100, [b"x"])


def test_write_hashed_feeds_the_hasher_exactly_the_bytes_sent(s3):
    """The writer's blake3 is fed from the part bodies, in order, across buffers, pieces and
    parts (two parts per chunk here); every part's CRC-32 passed the server's check."""
    import blake3

    store = open_store(s3.uri("hashed"), s3.options(part_size=CHUNK))
    data = bytes(range(251)) * ((4 * CHUNK + 12345) // 251)  # 2 chunks of 2 parts, and a tail
    unit = 2 * CHUNK
    sink = store.open_sink("data.bin", part_size=unit)
    digests = []
    for o in range(0, len(data), unit):
        h = blake3.blake3()
        end = min(len(data), o + unit)
        sink.write_hashed(o, [data[o : o + 1001], memoryview(data)[o + 1001 : end]], h)
        digests.append(h.hexdigest())
    sink.close()
    assert digests == [blake3.blake3(data[o : o + unit]).hexdigest() for o in range(0, len(data), unit)]
    assert s3.client().get_object(Bucket=s3.bucket, Key="hashed/data.bin")["Body"].read() == data
    small = store.open_sink("small.bin", part_size=unit)  # one short chunk: a single PUT
    h = blake3.blake3()
    small.write_hashed(0, [b"abc", memoryview(b"defg")], h)
    small.close()
    assert h.hexdigest() == blake3.blake3(b"abcdefg").hexdigest() and store.read_small("small.bin") == b"abcdefg"


def test_gap_or_abort_never_completes_an_upload(moto):
    store = open_store(moto.uri("gaps"), moto.options())
    sink = store.open_sink("gap.bin", part_size=CHUNK)
    sink.write_at(0, [bytes(CHUNK)])
    sink.write_at(2 * CHUNK, [b"end"])  # part 2 is missing
    with pytest.raises(CheckpointError, match=r"bytes \[5242880, 10485760\) were never written") as info:
        sink.close()
    assert info.value.byte_range == (CHUNK, 2 * CHUNK)
    sink.abort()
    sink.abort()
    half = store.open_sink("half.bin", part_size=CHUNK)
    half.write_at(0, [bytes(CHUNK)])
    half.abort()
    with pytest.raises(CheckpointError, match="aborted"):
        half.close()
    assert moto.open_uploads() == [] and moto.keys("gaps/") == []


def test_commit_record_is_exclusive_unless_replace(moto, proxy):
    store = open_store(moto.uri("commit"), moto.options())
    store.put_commit_record("manifest.json", b"one", replace=False)
    with pytest.raises(CheckpointExistsError):
        store.put_commit_record("manifest.json", b"two", replace=False)
    assert store.read_small("manifest.json") == b"one"
    store.put_commit_record("manifest.json", b"three", replace=True)
    assert store.read_small("manifest.json") == b"three"
    via_proxy = open_store(moto.uri("commit2"), type(moto)("moto", proxy.url, moto.bucket).options())
    # Another writer committed first.
    moto.client().put_object(Bucket=moto.bucket, Key="commit2/manifest.json", Body=b"theirs")
    with pytest.raises(CheckpointExistsError):
        via_proxy.put_commit_record("manifest.json", b"ours", replace=False)
    # A server that refuses conditional writes: check-then-put.
    proxy.add("501", op="PutObject", header="If-None-Match", times=1)
    via_proxy.put_commit_record("m2.json", b"ours", replace=False)
    assert via_proxy.read_small("m2.json") == b"ours"
    # A lost response: the first PUT landed, the retry meets our own object, not a rival's.
    proxy.add("reset_after", op="PutObject", key_contains="m3.json", times=1)
    via_proxy.put_commit_record("m3.json", b"mine", replace=False)
    assert via_proxy.read_small("m3.json") == b"mine"
    assert [a for a, _, _ in proxy.log.faults] == ["501", "reset_after"]


# -- corruption -----------------------------------------------------------------------------------
def test_corruption_of_one_object_is_detected_and_named(s3):
    state = s3_state()
    save(state, s3, "bad")
    client = s3.client()
    data_key = next(k for k in s3.keys("bad/") if k.endswith(".bin"))
    body = bytearray(client.get_object(Bucket=s3.bucket, Key=data_key)["Body"].read())
    body[CHUNK + 12345] ^= 0x01  # inside "w", in its second chunk
    client.put_object(Bucket=s3.bucket, Key=data_key, Body=bytes(body))
    with pytest.raises(BaseException) as info:
        load(state, s3, "bad")
    err = checkpoint_error(info)
    assert isinstance(err, CorruptCheckpointError)
    assert err.path == f"s3://{s3.bucket}/{data_key}" and err.byte_range == (CHUNK, 2 * CHUNK)
    assert err.key == "w" and "Affected keys: w." in str(err)
    # Truncated, missing, garbled manifest: caught by read_metadata before any data is read.
    # (dcp.load turns errors raised there into an AssertionError with our message, so the
    # typed error is checked on the reader itself.)
    reader = CheckpointReader(s3.uri("bad"), **s3.options())
    client.put_object(Bucket=s3.bucket, Key=data_key, Body=bytes(body[: 3 * CHUNK]))
    with pytest.raises(CorruptCheckpointError, match="truncated") as info:
        reader.read_metadata()
    assert info.value.path == f"s3://{s3.bucket}/{data_key}" and info.value.byte_range[0] == 3 * CHUNK
    client.delete_object(Bucket=s3.bucket, Key=data_key)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        reader.read_metadata()
    client.put_object(Bucket=s3.bucket, Key="bad/manifest.json", Body=b'{"format": "goodput-ckpt", "vers')
    with pytest.raises(CorruptCheckpointError, match="manifest"):
        reader.read_metadata()
    client.put_object(Bucket=s3.bucket, Key=data_key, Body=bytes(body))
    client.delete_object(Bucket=s3.bucket, Key="bad/manifest.json")
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        reader.read_metadata()


# -- configuration ----------------------------------------------------------------------------------
def test_config_is_checked():
    with pytest.raises(TypeError, match="unknown option.*endpoint"):
        open_store("s3://bkt/x", {"endpoint": "http://127.0.0.1:1"})
    for bad in (
        {"max_concurrency": 0},
        {"part_size": 4 * MiB},
        {"addressing_style": "sideways"},
        {"max_attempts": 0},
        {"retry_time_limit": -1},
        {"read_timeout": 0},
        {"endpoint_url": "127.0.0.1:9000"},
        {"stale_upload_age": -1},
        {"stale_upload_age": True},
    ):
        with pytest.raises(ValueError):
            S3Config(**bad)
    with pytest.raises(TypeError):
        S3Config(max_concurrency="8")
    with pytest.raises(ValueError, match="must not contain credentials") as info:
        S3Config(endpoint_url=f"http://{ACCESS_KEY}:{SECRET_KEY}@127.0.0.1:9000")
    assert SECRET_KEY not in str(info.value) and ACCESS_KEY not in str(info.value)
    client = boto3.client("s3", region_name="us-east-1")
    with pytest.raises(ValueError, match="cannot be combined with client"):
        S3Config(client=client, endpoint_url="http://127.0.0.1:9000")
    with pytest.raises(ValueError, match="either client or session"):
        S3Config(client=client, session=boto3.session.Session())
    with pytest.raises(TypeError, match="S3 client"):
        S3Config(client=boto3.client("sqs", region_name="us-east-1"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        S3Config().max_attempts = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "uri, bucket, prefix",
    [
        ("s3://bkt/a/b", "bkt", "a/b"),
        ("s3://bkt/a/b/", "bkt", "a/b"),
        ("s3://bkt", "bkt", ""),
        ("s3://bkt/", "bkt", ""),
    ],
)
def test_uri_parsing(uri, bucket, prefix):
    assert parse_s3_uri(uri) == (bucket, prefix)
    assert is_supported_uri(uri)
    assert S3Store(uri).uri == (f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}")


@pytest.mark.parametrize("uri", ["s3://", "s3:///x", "s3://bkt/a/../b", "s3://bkt/a//b", "s3://user@bkt/x"])
def test_bad_uris(uri):
    assert not is_supported_uri(uri)
    with pytest.raises((ValueError, CheckpointError)):
        open_store(uri)


def test_endpoint_from_environment(moto, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
    store = open_store(moto.uri("env"), {"addressing_style": "path"})
    store.put_commit_record("m.json", b"hello", replace=True)
    assert moto.client().get_object(Bucket=moto.bucket, Key="env/m.json")["Body"].read() == b"hello"
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url.replace("://", f"://{ACCESS_KEY}:{SECRET_KEY}@"))
    with pytest.raises(CheckpointError, match="contains credentials") as info:
        open_store(moto.uri("env"), {"addressing_style": "path"}).list()
    assert SECRET_KEY not in str(info.value) and ACCESS_KEY not in str(info.value)


def test_user_client_and_session(moto):
    client = moto.client()
    state = s3_state()
    dcp.save(state, storage_writer=CheckpointWriter(moto.uri("own"), chunk_size=CHUNK, client=client))
    assert_tree_equal(load(state, moto, "own"), state)
    store = open_store(moto.uri("own"), {"client": client})
    assert store.client() is client and "client" not in repr(store)
    with pytest.raises(TypeError, match="thread executor"):
        pickle.dumps(store)
    session = boto3.session.Session(aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)
    store = open_store(moto.uri("own"), moto.options(session=session))
    assert store.read_small("manifest.json") is not None


def test_credentials_never_leak(moto, proxy, seaweed_server, caplog):
    caplog.set_level(logging.DEBUG, logger="goodput_ckpt")
    texts = []
    state = s3_state()
    writer = CheckpointWriter(moto.uri("creds"), chunk_size=CHUNK, **moto.options())
    texts += [repr(writer.store), repr(writer.store.config), pickle.dumps(writer).decode("latin-1")]
    dcp.save(state, storage_writer=writer)
    texts.append(moto.client().get_object(Bucket=moto.bucket, Key="creds/manifest.json")["Body"].read().decode())
    # A server that echoes the access key id in its error body (as AWS does for bad signatures),
    # first on the manifest, then on the data.
    target = type(moto)("moto", proxy.url, moto.bucket)
    proxy.add("403_echo", op="GetObject", times=1)
    with pytest.raises(CheckpointError, match="SignatureDoesNotMatch") as echoed:
        CheckpointReader(target.uri("creds"), **target.options()).read_metadata()
    proxy.add("403_echo", op="GetObject", key_contains=".bin")
    with pytest.raises(BaseException) as on_data:
        load(state, target, "creds")
    # A real signature check: SeaweedFS with the right key id and a wrong secret.
    wrong = boto3.session.Session(aws_access_key_id=ACCESS_KEY, aws_secret_access_key="not-" + SECRET_KEY)
    with pytest.raises(CheckpointError, match="SignatureDoesNotMatch|AccessDenied|InvalidAccessKeyId") as real:
        open_store(
            f"s3://{moto.bucket}/creds",
            {"session": wrong, "endpoint_url": seaweed_server.url, "addressing_style": "path"},
        ).list()
    missing_bucket = type(moto)("moto", moto.url, "no-such-bucket-here")
    with pytest.raises(BaseException) as no_bucket:
        save(state, missing_bucket, "x")
    errors = [echoed.value, checkpoint_error(on_data), real.value, checkpoint_error(no_bucket)]
    assert "SignatureDoesNotMatch" in str(errors[1]) and "NoSuchBucket" in str(errors[3])
    for e in errors:
        while e is not None:  # the error and every cause chained to it
            texts += [str(e), repr(e), str(getattr(e, "path", ""))]
            e = e.__cause__ or e.__context__
    texts.append(caplog.text)
    for text in texts:
        assert ACCESS_KEY not in text and SECRET_KEY not in text, text


def test_storage_options_mapping(moto):
    """``storage_options={...}`` (the spelling of issue 3 and of fsspec users) works like flat
    options, for the writer, the reader and open_store, and mixes with them."""
    nested = {"endpoint_url": moto.url, "addressing_style": "path", "region": "us-east-1"}
    state = s3_state()
    dcp.save(state, storage_writer=CheckpointWriter(moto.uri("nested"), chunk_size=CHUNK, storage_options=nested))
    dest = zeros_like(state)
    reader = CheckpointReader(
        moto.uri("nested"),
        thread_count=2,
        endpoint_url=moto.url,
        storage_options={"addressing_style": "path", "max_concurrency": 4},
    )
    dcp.load(dest, storage_reader=reader)
    assert_tree_equal(dest, state)
    assert reader.store.config.max_concurrency == 4 and reader.store.config.endpoint_url == moto.url
    assert (
        open_store(moto.uri("nested"), {"storage_options": nested}).config
        == open_store(moto.uri("nested"), nested).config
    )
    with pytest.raises(TypeError, match=r"unknown option\(s\) bogus for the S3 backend; known options: .*endpoint_url"):
        CheckpointWriter(moto.uri("x"), chunk_size=CHUNK, storage_options={**nested, "bogus": 1})
    with pytest.raises(TypeError, match=r"key, secret .*key -> aws_access_key_id; secret -> aws_secret_access_key"):
        CheckpointReader(moto.uri("x"), storage_options={"key": "k", "secret": "s"})
    with pytest.raises(TypeError, match="endpoint_url given both directly and in storage_options"):
        CheckpointReader(moto.uri("x"), endpoint_url=moto.url, storage_options=nested)
    with pytest.raises(TypeError, match="storage_options must be a mapping"):
        open_store(moto.uri("x"), {"storage_options": [("endpoint_url", moto.url)]})


EXPLICIT_KEY_ID = "GOODPUTEXPLICITKEY9Z"
EXPLICIT_SECRET = "goodput-explicit-secret-Qm7Rt2"
EXPLICIT_TOKEN = "goodput-explicit-token-Hw4Np8"


def test_explicit_credentials_are_used_and_never_leak(moto, seaweed, caplog):
    """Credentials in ``storage_options`` reach boto3 and nothing else: no log record (the secret
    key in none at all, not even botocore's; the key id and token in none of ours), no message,
    no repr, no stored object."""
    caplog.set_level(logging.DEBUG)
    creds = {
        "aws_access_key_id": EXPLICIT_KEY_ID,
        "aws_secret_access_key": EXPLICIT_SECRET,
        "aws_session_token": EXPLICIT_TOKEN,
    }
    opts = {"storage_options": {**moto.options(), **creds}}
    state = s3_state()
    writer = CheckpointWriter(moto.uri("explicit"), chunk_size=CHUNK, **opts)
    assert writer.store.client()._request_signer._credentials.secret_key == EXPLICIT_SECRET  # boto3 got them
    texts = [repr(writer), repr(writer.store), repr(writer.store.config), str(writer.store.config)]
    dcp.save(state, storage_writer=writer)
    reader = CheckpointReader(moto.uri("explicit"), **opts)
    texts += [repr(reader), repr(reader.store)]
    dest = zeros_like(state)
    dcp.load(dest, storage_reader=reader)
    assert_tree_equal(dest, state)
    client = moto.client()
    for key in moto.keys("explicit/"):  # every file of the checkpoint, the manifest included
        texts.append(client.get_object(Bucket=moto.bucket, Key=key)["Body"].read().decode("latin-1"))

    errors = []
    # A server that checks signatures (SeaweedFS) refuses a wrong secret: it was really used.
    wrong = {**seaweed.options(), "aws_access_key_id": ACCESS_KEY, "aws_secret_access_key": "not-" + SECRET_KEY}
    with pytest.raises(CheckpointError, match="SignatureDoesNotMatch|AccessDenied|InvalidAccessKeyId") as refused:
        open_store(seaweed.uri("x"), {"storage_options": wrong}).list()
    errors.append(refused.value)
    right = {**seaweed.options(), "aws_access_key_id": ACCESS_KEY, "aws_secret_access_key": SECRET_KEY}
    assert open_store(seaweed.uri("x"), {"storage_options": right}).list() == []
    missing_bucket = type(moto)("moto", moto.url, "no-such-bucket-here")
    with pytest.raises(BaseException) as no_bucket:
        dcp.save(
            state,
            storage_writer=CheckpointWriter(
                missing_bucket.uri("x"), chunk_size=CHUNK, storage_options={**missing_bucket.options(), **creds}
            ),
        )
    errors.append(checkpoint_error(no_bucket))
    for bad in (
        {**creds, "bogus": EXPLICIT_SECRET},  # unknown key: named, its value not quoted
        {"aws_access_key_id": EXPLICIT_KEY_ID, "aws_secret_access_key": EXPLICIT_SECRET.encode()},  # wrong type
        {"aws_secret_access_key": EXPLICIT_SECRET},  # half a key pair
        {"aws_session_token": EXPLICIT_TOKEN},
        {**creds, "session": boto3.session.Session()},
    ):
        with pytest.raises((TypeError, ValueError)) as info:
            open_store(moto.uri("x"), {"storage_options": {**moto.options(), **bad}})
        errors.append(info.value)
    with pytest.raises(TypeError, match="aws_secret_access_key given both") as twice:
        CheckpointReader(moto.uri("x"), aws_secret_access_key=EXPLICIT_SECRET, storage_options=creds)
    errors.append(twice.value)
    for e in errors:
        while e is not None:  # the error and every cause chained to it
            texts += [str(e), repr(e), str(getattr(e, "path", ""))]
            e = e.__cause__ or e.__context__
    for text in texts:
        for secret in (EXPLICIT_KEY_ID, EXPLICIT_SECRET, EXPLICIT_TOKEN, SECRET_KEY):
            assert secret not in text, (secret, text[:2000])
    # Logs: botocore's own DEBUG wire log shows request headers (the key id, the session token),
    # as for any boto3 program; the secret key is never sent, so it is in no record at all.
    assert all(EXPLICIT_SECRET not in r.getMessage() and SECRET_KEY not in r.getMessage() for r in caplog.records)
    ours = [r.getMessage() for r in caplog.records if not r.name.startswith("botocore")]
    assert not [m for m in ours if EXPLICIT_KEY_ID in m or EXPLICIT_TOKEN in m]


def test_client_settings():
    """No network: the client our store builds (retries are ours; no SHA-256 of bodies over TLS)."""

    def signing(url: str, **kw) -> bool | None:
        client = open_store("s3://bkt/x", {"endpoint_url": url, "region": "us-east-1", **kw}).client()
        return client.meta.config.s3.get("payload_signing_enabled")

    # With CRCs (the default) bodies are never SHA-256 signed; without, only over plain http.
    assert signing("https://127.0.0.1:1") is False and signing("http://127.0.0.1:1") is False
    assert signing("https://127.0.0.1:1", checksums=False) is False
    assert signing("http://127.0.0.1:1", checksums=False) is None  # botocore's default: signed
    plain = open_store(
        "s3://bkt/x", {"endpoint_url": "http://127.0.0.1:1", "region": "us-east-1", "max_concurrency": 40}
    )
    config = plain.client().meta.config
    assert config.retries["total_max_attempts"] == 1 and config.max_pool_connections >= 80
    assert config.request_checksum_calculation == "when_required"
    assert (
        plain.traits.min_part_size == 5 * MiB
        and open_store("s3://b/x", {"part_size": 16 * MiB}).traits.min_part_size == 16 * MiB
    )


def test_part_bodies_are_reused_across_saves(moto):
    """A save takes the part bodies an earlier save (another writer, another store) gave back,
    instead of page-faulting fresh ones; a body is kept once per part size, up to the store's
    max_concurrency."""
    from goodput_ckpt.storage._s3_bodies import BODIES

    BODIES.clear()
    data = bytes(range(256)) * (3 * CHUNK // 256)  # 3 full parts
    fresh = []
    for step in range(2):
        before = BODIES.fresh
        store = open_store(moto.uri(f"reuse/{step}"), moto.options(max_concurrency=2))
        sink = store.open_sink("data.bin", part_size=CHUNK)
        for o in range(0, len(data), CHUNK):
            sink.write_at(o, [memoryview(data)[o : o + CHUNK]])
        sink.close()
        assert store.read_small("data.bin", max_bytes=len(data)) == data
        fresh.append(BODIES.fresh - before)
    # The first save makes bodies (at most one per part); the second, another store's save,
    # makes none: it takes what the first gave back.
    assert 1 <= fresh[0] <= 3 and fresh[1] == 0, fresh
    BODIES.clear()


def test_part_checksums_use_the_fastest_crc32(s3):
    """Parts are summed with ISA-L's CRC-32 where isal is installed (the same value as zlib's),
    and the servers accept those checksums (a wrong one fails with BadDigest)."""
    import os
    import zlib

    from goodput_ckpt.storage import _s3_bodies

    try:
        from isal import isal_zlib
    except ImportError:
        pytest.skip("isal is not installed: zlib's CRC-32 is used")
    assert _s3_bodies.crc32 is isal_zlib.crc32
    data = os.urandom(2 * CHUNK + 77)
    assert _s3_bodies.crc32(data) == zlib.crc32(data)
    store = open_store(s3.uri("crc"), s3.options())
    sink = store.open_sink("data.bin", part_size=CHUNK)
    for o in range(0, len(data), CHUNK):
        sink.write_at(o, [memoryview(data)[o : o + CHUNK]])
    sink.close()
    assert s3.client().get_object(Bucket=s3.bucket, Key="crc/data.bin")["Body"].read() == data
