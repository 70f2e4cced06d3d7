"""Batched deletes and sizes from a listing on S3 (goodput_ckpt/storage/_s3_delete.py, the
``delete_many`` / ``list_sizes`` of S3Store, and ``delete_files`` / ``file_sizes`` of bulk.py).

Requests are counted on the store's real boto3 client (``helpers.s3_requests.RequestCounter``),
against a real SeaweedFS server; request-level faults come from the fault proxy in front of
moto. S3 answers a ``DeleteObjects`` per key, and no real server can be made to fail one key
of a batch, so the per-key answers are given by botocore's own ``Stubber`` on a real client
(it checks every request against S3's API model).
"""

from __future__ import annotations

import pytest
from helpers.s3_requests import RequestCounter, by_operation

from goodput_ckpt.errors import CheckpointError
from goodput_ckpt.storage import LocalStore, S3Config, S3Store, open_store
from goodput_ckpt.storage.base import BatchDelete, SizedListing
from goodput_ckpt.storage.bulk import delete_files, file_sizes


def _store(target, prefix: str, counter: RequestCounter | None = None, **extra) -> S3Store:
    opts = target.options(**extra)
    if counter is not None:
        opts["session"] = counter.session()
    return open_store(target.uri(prefix), opts)


def _fill(target, prefix: str, n: int, stem: str = "d/f") -> list[str]:
    from concurrent.futures import ThreadPoolExecutor

    client = target.client()
    names = [f"{stem}{i:05d}.bin" for i in range(n)]
    with ThreadPoolExecutor(8) as pool:
        body = lambda name: b"x" * (len(name) % 7)  # noqa: E731
        list(
            pool.map(
                lambda name: client.put_object(Bucket=target.bucket, Key=f"{prefix}/{name}", Body=body(name)), names
            )
        )
    return names


def test_delete_many_batches_a_thousand_keys_a_request(seaweed):
    names = _fill(seaweed, "run", 2100)
    counter = RequestCounter()
    store = _store(seaweed, "run", counter)
    assert isinstance(store, BatchDelete)
    delete_files(store, [*names, "d/never-written.bin"])  # a missing file is not an error
    assert by_operation(counter.take()) == {"DeleteObjects": 3}
    assert seaweed.keys("run/") == []


def test_sizes_come_from_one_listing(seaweed):
    names = _fill(seaweed, "run", 1500)
    counter = RequestCounter()
    store = _store(seaweed, "run", counter)
    assert isinstance(store, SizedListing)
    sizes = file_sizes(store, [*names, "d/missing.bin"])
    assert sizes == {**{n: len(n) % 7 for n in names}, "d/missing.bin": None}
    # Two pages of the listing; only the file it did not show is asked for by itself.
    assert by_operation(counter.take()) == {"HeadObject": 1, "ListObjectsV2": 2}


def test_a_location_holding_much_else_lists_a_bounded_number_of_pages(moto):
    """A checkpoint's 3 files under a location that also holds 4,500 other objects, listed
    first (``a/`` sorts before ``d/``): the listing stops after two pages, and the files it did
    not reach are asked for by themselves (not the 5 pages of a whole listing)."""
    _fill(moto, "run", 4500, stem="a/other")
    names = _fill(moto, "run", 3)
    counter = RequestCounter()
    assert file_sizes(_store(moto, "run", counter), names) == {n: len(n) % 7 for n in names}
    assert by_operation(counter.take()) == {"HeadObject": 3, "ListObjectsV2": 2}


def test_sizes_without_permission_to_list_ask_each_file(moto, proxy):
    names = _fill(moto, "run", 3)
    proxy.add("403_echo", op="ListObjects")
    moto.url = proxy.url
    store = _store(moto, "run")
    assert file_sizes(store, names) == {n: len(n) % 7 for n in names}
    assert proxy.count("HeadObject") == 3


def test_a_failed_batch_request_is_retried(moto, proxy):
    names = _fill(moto, "run", 5)
    proxy.add("503", op="POSTBucket", times=1)
    moto.url = proxy.url
    delete_files(_store(moto, "run"), names)
    assert proxy.count("POSTBucket") == 2
    assert moto.keys("run/") == []


def test_a_server_without_batch_deletes_gets_one_delete_per_key(moto, proxy):
    names = _fill(moto, "run", 4)
    proxy.add("501", op="POSTBucket")
    moto.url = proxy.url
    delete_files(_store(moto, "run"), names)
    assert proxy.count("POSTBucket") == 1 and proxy.count("DeleteObject") == 4
    assert moto.keys("run/") == []


def _stubbed(moto, answers: list[dict]) -> tuple[S3Store, object]:
    import boto3
    from botocore.stub import ANY, Stubber

    client = boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1")
    stub = Stubber(client)
    for errors in answers:
        stub.add_response("delete_objects", {"Errors": errors}, {"Bucket": moto.bucket, "Delete": ANY})
    stub.activate()
    return S3Store(moto.uri("run"), S3Config(client=client)), stub


def test_keys_that_failed_transiently_are_sent_again(moto):
    store, stub = _stubbed(
        moto,
        [
            [
                {"Key": "run/b", "Code": "InternalError", "Message": "try again"},
                {"Key": "run/c", "Code": "NoSuchKey", "Message": "gone"},
            ],
            [],
        ],
    )
    store.delete_many(["a", "b", "c"])
    stub.assert_no_pending_responses()


def test_a_key_refused_raises_naming_it(moto):
    store, _ = _stubbed(moto, [[{"Key": "run/b", "Code": "AccessDenied", "Message": "no"}]])
    with pytest.raises(CheckpointError, match=r"s3://.*/run/b \(AccessDenied"):
        store.delete_many(["a", "b"])


def test_other_stores_delete_one_at_a_time(tmp_path):
    store = LocalStore(str(tmp_path))
    for n in ("a/x", "a/y", "b"):
        (tmp_path / n).parent.mkdir(exist_ok=True)
        (tmp_path / n).write_bytes(b"1")
    assert not isinstance(store, BatchDelete) and not isinstance(store, SizedListing)
    assert file_sizes(store, ["a/x", "zz"]) == {"a/x": 1, "zz": None}
    delete_files(store, ["a/x", "a/y", "missing"])
    assert store.list() == ["b"]


def test_sizes_asked_one_by_one_go_in_parallel(moto, proxy):
    """Without permission to list, every file's size is a HEAD of its own: sent from several
    threads at once (16,384 of them one after the other are minutes at 10 ms a request)."""
    import threading

    names = _fill(moto, "run", 40)
    proxy.add("403_echo", op="ListObjects")
    moto.url = proxy.url
    counter = RequestCounter()
    threads: set[int] = set()
    counter.session().events.register(
        "before-parameter-build.s3.HeadObject", lambda **_: threads.add(threading.get_ident())
    )
    assert file_sizes(_store(moto, "run", counter), [*names, "d/missing.bin"]) == {
        **{n: len(n) % 7 for n in names},
        "d/missing.bin": None,
    }
    assert by_operation(counter.take()) == {"HeadObject": 41, "ListObjectsV2": 1}
    assert len(threads) > 1 and threading.get_ident() not in threads
