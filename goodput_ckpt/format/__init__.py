"""The goodput checkpoint format (format version 2, reading 1 and 2): the manifest schema, its validation, and DCP ``Metadata`` rebuilding."""

from .manifest import (
    ALIGNMENT,
    DTYPE_SIZES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    ChunkEntry,
    FileEntry,
    Manifest,
    ObjectEntry,
    TensorEntry,
    parse_manifest,
)

__all__ = [
    "ALIGNMENT",
    "DTYPE_SIZES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ChunkEntry",
    "FileEntry",
    "Manifest",
    "ObjectEntry",
    "TensorEntry",
    "parse_manifest",
]
