"""Reading and hashing a file in 8 threads: each 16 MiB task read whole then hashed, against read
and hashed a piece at a time (``CheckpointReader``'s ``READ_PIECE`` on local disks), cold (the file
dropped from the page cache first) and warm. The raw pattern, without the reader around it.

Run: ``.venv/bin/python benchmarks/probe_read_pieces.py --size 144MiB --repeats 5``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import blake3
import numpy as np

from goodput_ckpt.cli._output import parse_size

TASK = 16 << 20


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="144MiB")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    n = parse_size(args.size)
    scratch = tempfile.mkdtemp(prefix="probe-pieces-")
    path = os.path.join(scratch, "f")
    with open(path, "wb") as f:
        f.write(os.urandom(n))
        f.flush()
        os.fsync(f.fileno())
    dst = np.ones(n, np.uint8)  # touched: no page faults in the timed reads
    fd = os.open(path, os.O_RDONLY)

    def task(start: int, piece: int | None) -> bytes:
        h = blake3.blake3()
        end = min(start + TASK, n)
        step = piece or (end - start)
        for at in range(start, end, step):
            view = memoryview(dst)[at : min(at + step, end)]
            os.preadv(fd, [view], at)
            h.update(view)
        return h.digest()

    cases = {"16 MiB read, then hashed": None, "2 MiB pieces": 2 << 20, "1 MiB pieces": 1 << 20}
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        with ThreadPoolExecutor(8) as pool:
            for cache in ("cold", "warm"):
                for _ in range(args.repeats):
                    for name, piece in cases.items():
                        if cache == "cold":
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        t, c = time.perf_counter(), time.process_time()
                        list(pool.map(lambda s, p=piece: task(s, p), range(0, n, TASK)))
                        out.setdefault((cache, name), []).append((time.perf_counter() - t, time.process_time() - c))
    finally:
        os.close(fd)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{args.size}, 8 threads, {args.repeats} repeats; load average {os.getloadavg()[0]:.1f}")
    for (cache, name), v in out.items():
        wall = [w for w, _ in v]
        print(
            f"{cache} {name:26s} wall median {1e3 * statistics.median(wall):6.1f} ms (min {1e3 * min(wall):6.1f}) "
            f"CPU median {1e3 * statistics.median(c for _, c in v):6.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
