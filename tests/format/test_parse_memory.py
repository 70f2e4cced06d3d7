"""Parsing a manifest needs memory in proportion to its size, with a stated factor (issue 16,
item 8; docs/format.md, "Limits that bound work"): the decoded JSON document is the peak, and the
records built from it replace it item by item and chunk by chunk instead of adding to it.

Measured with tracemalloc, which counts every allocation the parse makes (deterministic for a
given manifest), on the densest shape the format allows: one tensor of many small chunks, where
the JSON document is largest relative to the bytes.
"""

from __future__ import annotations

import gc
import tracemalloc

from _manifests import staircase_manifest

from goodput_ckpt.format.manifest import parse_manifest

#: docs/format.md: "parsing needs at most about 8x the manifest's size".
PEAK_FACTOR = 8
#: ...and the parsed manifest keeps at most about 4x.
KEPT_FACTOR = 4


def test_parse_peak_memory_is_a_small_multiple_of_the_manifest_size():
    # 20,000 chunks in one tensor, about 1.7 MB: the factors are the same as at 60,000 chunks
    # (5.4 MB: peak 7.7x, kept 3.1x), and tracemalloc makes the parse several times slower.
    raw = staircase_manifest(10_000)
    assert 1_000_000 < len(raw) < 4_000_000
    gc.collect()
    tracemalloc.start()
    try:
        manifest = parse_manifest(raw)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(manifest.items["w"].chunks) == 20_000
    assert peak < PEAK_FACTOR * len(raw), f"peak {peak / len(raw):.2f}x the manifest size"
    assert kept < KEPT_FACTOR * len(raw), f"kept {kept / len(raw):.2f}x the manifest size"
