"""The manifest's seal: its own blake3 digest, appended as the last member of the JSON object.

Checked from the raw bytes before anything is parsed, so a reader needs no re-serialization to
know that the commit record is the one its writer sealed (docs/format.md, "The digest").
No torch here.
"""

from __future__ import annotations

from typing import Any

import blake3

from ..errors import CorruptCheckpointError

__all__ = ["check_seal", "refuse_damaged_version", "seal_manifest", "seal_of"]

_DIGEST_MEMBER = b',"digest":"'


def seal_manifest(body: bytes) -> bytes:
    """Append the manifest's own digest as its last member.

    ``body`` is the serialized JSON object without a digest. The result is the same object
    with a final ``"digest"`` member holding the blake3 (hex) of every byte before the
    ``,"digest":"`` sequence, so a reader can check the manifest's integrity from its raw bytes
    without re-serializing it.
    """
    body = body.rstrip()
    if not body.endswith(b"}") or body[:-1].rstrip().endswith(b"{"):
        raise ValueError("seal_manifest needs a serialized, non-empty JSON object")
    # A view, not a copy: a 405B state's record is 34 MB, and each fresh copy of it costs page
    # faults as well as the copy; the result is the one copy made.
    with memoryview(body) as view:
        head = view[:-1]
        return b"".join((head, _DIGEST_MEMBER, blake3.blake3(head).hexdigest().encode(), b'"}'))


def _recorded(data: bytes) -> tuple[int, bytes] | None:
    """``(digest_start, recorded_digest)`` for a manifest that ends with a digest member of the
    form :func:`seal_manifest` writes, or ``None`` when it does not. Nothing is hashed."""
    text = data.rstrip()
    start = len(text) - len(b'"}') - 64 - len(_DIGEST_MEMBER)
    if start < 0 or text[start : start + len(_DIGEST_MEMBER)] != _DIGEST_MEMBER or not text.endswith(b'"}'):
        return None
    return start, text[start + len(_DIGEST_MEMBER) : -2]


def _read_seal(data: bytes) -> tuple[int, bool] | None:
    """``(digest_start, matches)`` for a manifest that ends with a digest member of the form
    :func:`seal_manifest` writes, or ``None`` when it does not."""
    found = _recorded(data)
    if found is None:
        return None
    start, recorded = found
    with memoryview(data) as view:  # no copy of a 34 MB record just to hash it
        return start, recorded == blake3.blake3(view[:start]).hexdigest().encode()


def seal_of(data: bytes) -> str | None:
    """The digest a sealed manifest's raw bytes record (``None``: none), without checking it
    (and without hashing: the caller has checked it, as :func:`read_commit_record` has).

    It names the record: two sealed records with the same digest are the same bytes, so
    comparing 64 characters tells whether two copies hold the same commit record.
    """
    found = _recorded(data)
    return None if found is None else found[1].decode()


def check_seal(data: bytes, where_file: str) -> None:
    """Verify the digest written by :func:`seal_manifest` (see docs/format.md).

    Raises:
        CorruptCheckpointError: the digest is absent or does not match.
    """
    seal = _read_seal(data)
    if seal is None:
        raise CorruptCheckpointError(
            f"manifest {where_file} does not end with its digest member: it was edited or "
            "truncated by something other than goodput-ckpt",
            path=where_file,
        )
    start, matches = seal
    if not matches:
        raise CorruptCheckpointError(
            f"manifest {where_file} fails its own checksum: the commit record was edited or "
            "damaged; restore an earlier checkpoint",
            path=where_file,
            byte_range=(0, start),
        )


def refuse_damaged_version(data: bytes, where_file: str, version: Any) -> None:
    """Tell a damaged ``version`` field from a genuinely newer manifest.

    A later version may seal its manifest another way, so an unknown version is normally
    reported as such. But when the bytes end with a digest member of this version's form and
    that digest does not match, the manifest was sealed and then changed: a flipped bit in the
    version digit is damage, not a manifest from the future.

    Raises:
        CorruptCheckpointError: the bytes carry this version's seal, and it does not match.
    """
    seal = _read_seal(data)
    if seal is not None and not seal[1]:
        raise CorruptCheckpointError(
            f"manifest {where_file} claims format version {version!r} but fails its own checksum: "
            "the commit record (its version field, or more) was damaged; restore an earlier checkpoint",
            path=where_file,
            byte_range=(0, seal[0]),
        )
