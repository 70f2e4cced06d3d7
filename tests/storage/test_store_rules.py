"""The rules every store shares (storage/store_rules.py)."""

from __future__ import annotations


def test_drop_done_continues_a_short_vectored_transfer():
    from goodput_ckpt.storage.store_rules import drop_done

    views = [memoryview(b"abc"), memoryview(b"defg"), memoryview(b"h")]
    drop_done(views, 0)
    assert [bytes(v) for v in views] == [b"abc", b"defg", b"h"]
    drop_done(views, 4)  # all of the first view and one byte of the second
    assert [bytes(v) for v in views] == [b"efg", b"h"]
    drop_done(views, 3)
    assert [bytes(v) for v in views] == [b"h"]
    drop_done(views, 1)
    assert views == []


def test_the_interface_module_still_exports_the_shared_rules():
    """Callers import them from storage.base (the module they lived in before the split)."""
    from goodput_ckpt.storage import base, store_rules

    for name in store_rules.__all__:
        assert getattr(base, name) is getattr(store_rules, name)
        assert name in base.__all__
