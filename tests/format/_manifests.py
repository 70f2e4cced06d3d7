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
        chunks.append(
            {"offsets": list(offsets), "sizes": list(sizes), "file": "f.bin", "offset": offset, "length": length}
        )
        offset += (length + 63) // 64 * 64
    doc = {
        "format": "goodput-ckpt",
        "version": 1,
        "world_size": 1,
        "byte_order": "little",
        "hash": {"algorithm": "blake3", "chunk_size": 1 << 30},
        "files": {"f.bin": {"size": offset, "chunks": ["0" * 64]}},
        "items": {"w": {"kind": "tensor", "dtype": "uint8", "shape": [n, n], "chunks": chunks}},
    }
    return seal_manifest(json.dumps(doc, separators=(",", ":")).encode())


def many_cells_manifest(files: int = 1024, runs: int = 4096) -> bytes:
    """A small manifest whose one grid describes ``files x runs`` one-byte cells (issue 33):
    ``uint8[files * runs]`` in blocks of one element, run ``k`` putting its ``files`` cells at
    byte ``64 k`` of every file. The default is 186 KB describing 4 M cells; a consumer
    that expands the grid into records pays seconds and hundreds of MB for it."""
    names = [f"data_{i:05d}.bin" for i in range(files)]
    doc = {
        "format": "goodput-ckpt",
        "version": 2,
        "world_size": files,
        "byte_order": "little",
        "hash": {"algorithm": "blake3", "chunk_size": 1 << 30},
        "files": {n: {"size": 64 * runs, "chunks": ["0" * 64]} for n in names},
        "items": {
            "w": {
                "kind": "tensor",
                "dtype": "uint8",
                "shape": [files * runs],
                "requires_grad": False,
                "grid": {"block": [1], "runs": [[files, 0, 1, 64 * k] for k in range(runs)]},
            }
        },
    }
    return seal_manifest(json.dumps(doc, separators=(",", ":")).encode())
