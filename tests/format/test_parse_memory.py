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
    raw = staircase_manifest(30_000)  # 60,000 chunks in one tensor
    assert 5_000_000 < len(raw) < 10_000_000
    gc.collect()
    tracemalloc.start()
    try:
        manifest = parse_manifest(raw)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(manifest.items["w"].chunks) == 60_000
    assert peak < PEAK_FACTOR * len(raw), f"peak {peak / len(raw):.2f}x the manifest size"
    assert kept < KEPT_FACTOR * len(raw), f"kept {kept / len(raw):.2f}x the manifest size"
