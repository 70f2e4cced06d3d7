"""Manifests built for the format tests (not a test module)."""

from __future__ import annotations

import json

from goodput_ckpt.format.manifest import seal_manifest


def staircase(n: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each column of an n x n tensor split at a different row: 2n boxes that all start at row 0
    or overlap along every dimension's sweep, the layout that made the old check quadratic."""
    boxes = []
    for col in range(n):
        cut = 1 + col % (n - 1)
        boxes.append(((0, col), (cut, 1)))
        boxes.append(((cut, col), (n - cut, 1)))
    return boxes


def staircase_manifest(n: int) -> bytes:
    chunks, offset = [], 0
    for offsets, sizes in staircase(n):
        length = sizes[0] * sizes[1]
        chunks.append({"offsets": list(offsets), "sizes": list(sizes), "file": "f.bin", "offset": offset, "length": length})
        offset += (length + 63) // 64 * 64
    doc = {
        "format": "goodput-ckpt", "version": 1, "world_size": 1, "byte_order": "little",
        "hash": {"algorithm": "blake3", "chunk_size": 1 << 30},
        "files": {"f.bin": {"size": offset, "chunks": ["0" * 64]}},
        "items": {"w": {"kind": "tensor", "dtype": "uint8", "shape": [n, n], "chunks": chunks}},
    }  # fmt: skip
    return seal_manifest(json.dumps(doc, separators=(",", ":")).encode())
