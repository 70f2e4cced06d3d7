"""Small versioned JSON documents (a job file, a sidecar of objects): the one check of what they say they are.

Each is a JSON object whose ``format`` names what it is and whose ``version`` says how to read
it. A reader takes only its own format, and refuses a version it does not know by naming it, as
the manifest's reader does (docs/format.md, Versioning). No torch here.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError

__all__ = ["parse_json_document"]


def parse_json_document(data: bytes, where: str, *, format_name: str, version: int, what: str) -> dict[str, Any]:
    """The JSON object in ``data``, checked to be a ``format_name`` document of ``version``.

    Args:
        where: the file, for messages. ``what``: how messages name the document ("job file").

    Raises:
        CorruptCheckpointError: not JSON, not an object, or not a ``format_name`` document.
        CheckpointError: a version this library does not read (``version`` set to it).
    """
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({e})", path=where) from None
    if not isinstance(doc, dict) or doc.get("format") != format_name:
        raise CorruptCheckpointError(f"{where} is not a {what} ({format_name})", path=where)
    if doc.get("version") != version:
        raise CheckpointError(
            f"{where} has {what} version {doc.get('version')!r}; this goodput-ckpt reads version {version}",
            path=where,
            version=doc.get("version"),
        )
    return doc
