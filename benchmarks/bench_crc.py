"""CRC implementations for S3 part checksums: throughput on one thread and on two, and CPU.

    .venv/bin/python benchmarks/bench_crc.py --size 512MiB --repeats 5

Sums ``--size`` bytes in 256 KiB pieces (``FILL_PIECE``, the unit the S3 sink sums) with each
installed implementation: zlib's and ISA-L's CRC-32 (S3's ``CRC32``), and ``crc32c`` and
``google-crc32c`` (S3's ``CRC32C``). With two threads, an implementation that holds the GIL
does not scale, which matters because part bodies are filled by several writer threads at once.
``google-crc32c`` only takes read-only buffers (``bytes``): a part body (``bytearray``) would
need a copy first, which is not counted here. Methods run in an order rotating per repeat;
the figures are the median, min and max over repeats, with the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import zlib
from collections.abc import Callable

PIECE = 256 << 10


def implementations() -> dict[str, Callable[[object, int], int]]:
    out: dict[str, Callable[[object, int], int]] = {"zlib crc32": lambda b, v: zlib.crc32(b, v)}
    try:
        from isal import isal_zlib

        out["isal crc32"] = lambda b, v: isal_zlib.crc32(b, v)
    except ImportError:
        print("isal not installed", file=sys.stderr)
    try:
        import crc32c

        out["crc32c crc32c"] = lambda b, v: crc32c.crc32c(b, v)
    except ImportError:
        print("crc32c not installed", file=sys.stderr)
    try:
        import google_crc32c

        out["google-crc32c"] = lambda b, v: google_crc32c.extend(v, b)
    except ImportError:
        print("google-crc32c not installed", file=sys.stderr)
    return out


def timed(fn: Callable[[object, int], int], piece: bytes, count: int, threads: int) -> tuple[float, float]:
    def work() -> None:
        v = 0
        for _ in range(count // threads):
            v = fn(piece, v)

    ts = [threading.Thread(target=work) for _ in range(threads)]
    c0, t0 = time.process_time(), time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--size", default="512MiB", help="bytes summed per measurement, e.g. 512MiB")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    size = int(a.size.removesuffix("MiB")) << 20 if a.size.endswith("MiB") else int(a.size)
    count = max(2, size // PIECE)
    piece = os.urandom(PIECE)
    impls = implementations()
    names = list(impls)
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {(n, t): [] for n in names for t in (1, 2)}
    load0 = os.getloadavg()
    order = []
    for rep in range(a.repeats):
        k = rep % len(names)
        order.append(names[k:] + names[:k])
        for name in order[-1]:
            for threads in (1, 2):
                samples[(name, threads)].append(timed(impls[name], piece, count, threads))
    gb = count * PIECE / 1e9
    print(f"{count * PIECE >> 20} MiB in {PIECE >> 10} KiB pieces, {a.repeats} repeats, {os.cpu_count()} CPUs")
    print("order: " + "; ".join(f"repeat {i + 1}: {', '.join(o)}" for i, o in enumerate(order)))
    print(
        f"load average at start {'/'.join(f'{x:.1f}' for x in load0)}, at end {'/'.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(f"{'implementation':<16}{'threads':>8}{'GB/s median':>13}{'min-max':>14}{'CPU-s/GB':>10}")
    for (name, threads), ss in samples.items():
        walls = [w for w, _ in ss]
        cpu = statistics.median(c for _, c in ss) / gb
        spread = f"{gb / max(walls):.1f}-{gb / min(walls):.1f}"
        print(f"{name:<16}{threads:>8}{gb / statistics.median(walls):>13.1f}{spread:>14}{cpu:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
