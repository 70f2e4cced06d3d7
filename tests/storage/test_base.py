"""The store interface's shared helpers."""

from __future__ import annotations


def test_drop_done_continues_a_short_vectored_transfer():
    from goodput_ckpt.storage.base import drop_done

    views = [memoryview(b"abc"), memoryview(b"defg"), memoryview(b"h")]
    drop_done(views, 0)
    assert [bytes(v) for v in views] == [b"abc", b"defg", b"h"]
    drop_done(views, 4)  # all of the first view and one byte of the second
    assert [bytes(v) for v in views] == [b"efg", b"h"]
    drop_done(views, 3)
    assert [bytes(v) for v in views] == [b"h"]
    drop_done(views, 1)
    assert views == []
