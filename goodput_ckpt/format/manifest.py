"""The manifest: the JSON commit record of a checkpoint (the goodput format). No torch here.

The manifest lists every file with its size and the blake3 of each fixed-size chunk, and every
state-dict item with where its bytes live. It is written last; a location without a valid
manifest is incomplete. This module is the public face of three others, one concern each:

- :mod:`.schema`: constants, limits and the records (:class:`Manifest` and its entries);
- :mod:`.seal`: the manifest's own digest, appended and checked (:func:`seal_manifest`);
- :mod:`.parse`: validation of everything a reader will trust (:func:`parse_manifest`).

The spec is ``docs/format.md``.
"""

from __future__ import annotations

from .parse import parse_manifest
from .schema import (
    ALIGNMENT,
    DTYPE_SIZES,
    FORMAT_NAME,
    FORMAT_VERSION,
    HASH_ALGORITHM,
    MANIFEST_NAME,
    MAX_CHUNK_SIZE,
    MAX_FILE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    MIN_CHUNK_SIZE,
    REFERENCES_VERSION,
    SUPPORTED_VERSIONS,
    ChunkEntry,
    FileEntry,
    Manifest,
    ObjectEntry,
    TensorEntry,
)
from .seal import seal_manifest

__all__ = [
    "ALIGNMENT",
    "DTYPE_SIZES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HASH_ALGORITHM",
    "MANIFEST_NAME",
    "MAX_CHUNK_SIZE",
    "MAX_FILE_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_NDIM",
    "MIN_CHUNK_SIZE",
    "REFERENCES_VERSION",
    "SUPPORTED_VERSIONS",
    "ChunkEntry",
    "FileEntry",
    "Manifest",
    "ObjectEntry",
    "TensorEntry",
    "parse_manifest",
    "seal_manifest",
]
