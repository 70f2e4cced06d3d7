"""TokenStream read throughput against a plain sequential read of the same shard files.

Writes ``--shards`` files of random ``uint16`` tokens (``--size`` in all), then times, alternating
per repeat:

- ``plain``: each file read start to end in 8 MiB ``readinto`` calls (local), or one streaming
  ``GetObject`` per file read in 8 MiB pieces (S3, boto3): what a loader that does nothing but
  read would cost;
- ``stream``: every sequence of a ``TokenStream`` (``num_workers=0``, one rank) iterated in
  Python, ``--seq-len`` tokens each, read in blocks of 8 MiB through ``open_store``, ``--read-ahead`` blocks in flight (the defaults).

The ratio is plain seconds / stream seconds (1.0: the stream costs nothing over the read), per
repeat; the report gives min/median/max over repeats, the order the methods ran in (alternating)
and the load average. Local files are read cold by default (``--cache cold``: each file's pages
are evicted with ``posix_fadvise(DONTNEED)`` before every timed pass, as a training job reads
shards it has not read yet); ``--cache warm`` reads them from the page cache, where the plain
read is a memory copy and the figure is the stream's Python overhead at its most visible. S3 runs
against a SeaweedFS server on 127.0.0.1 (the recipe of ``tests/helpers/s3.py``), which shares
the 2 cores.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_tokens.py --size 512MiB --shards 4 --repeats 3 [--s3]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the SeaweedFS recipe

from goodput_ckpt.data import TokenStream  # noqa: E402
from goodput_ckpt.tools._bench_scratch import evict_page_cache  # noqa: E402

PIECE = 8 << 20


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * m)
    return int(text)


def _stream_seconds(root: str, names: list[str], seq_len: int, ahead: int, options: dict) -> tuple[float, int]:
    ds = TokenStream(root, names, seq_len=seq_len, dtype="uint16", read_ahead=ahead, storage_options=options)
    t0, n = time.perf_counter(), 0
    for _ in ds:
        n += 1
    return time.perf_counter() - t0, n * seq_len * 2


def _plain_local(root: Path, names: list[str]) -> tuple[float, int]:
    buf = bytearray(PIECE)
    t0, total = time.perf_counter(), 0
    for name in names:
        with open(root / name, "rb", buffering=0) as f:
            while (got := f.readinto(buf)) > 0:
                total += got
    return time.perf_counter() - t0, total


def _plain_s3(client, bucket: str, prefix: str, names: list[str]) -> tuple[float, int]:
    t0, total = time.perf_counter(), 0
    for name in names:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"]
        for piece in body.iter_chunks(PIECE):
            total += len(piece)
    return time.perf_counter() - t0, total


def _iteration_floor(n: int, seq_len: int) -> float:
    """Seconds to iterate ``n`` sequence views of an in-memory tensor (median of 3): what any
    iterable yielding one tensor per sequence costs in Python before it reads a byte."""
    import torch

    rows = torch.zeros((n, seq_len), dtype=torch.uint16)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _row in rows.unbind(0):
            pass
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--read-ahead", type=int, default=8, help="TokenStream read_ahead (blocks in flight)")
    ap.add_argument("--s3", action="store_true", help="also against SeaweedFS on 127.0.0.1")
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold", help="local files: evicted before each pass, or cached")
    a = ap.parse_args(argv)
    per = _size(a.size) // a.shards // (a.seq_len * 2) * (a.seq_len * 2)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp, "shards")
        root.mkdir()
        names = [f"shard{k:03d}.bin" for k in range(a.shards)]
        for name in names:
            (root / name).write_bytes(rng.integers(0, 50257, per // 2, dtype=np.uint16).tobytes())
        mib = per * a.shards / (1 << 20)
        def cold(fn):
            def run():
                if a.cache == "cold":
                    for name in names:
                        evict_page_cache(str(root / name))
                return fn()

            return run

        targets = [(
            f"local ({a.cache})",
            cold(lambda: _plain_local(root, names)),
            cold(lambda: _stream_seconds(str(root), names, a.seq_len, a.read_ahead, {})),
        )]  # fmt: skip
        server = None
        if a.s3:
            import boto3
            from helpers.s3 import SeaweedServer, s3_env

            os.environ.update(s3_env())
            server = SeaweedServer(Path(tmp, "weed"))
            client = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1")
            client.create_bucket(Bucket="tokens")
            for name in names:
                client.upload_file(str(root / name), "tokens", f"shards/{name}")
            opts = {"endpoint_url": server.url, "addressing_style": "path", "region": "us-east-1"}
            targets.append((
                "s3",
                lambda: _plain_s3(client, "tokens", "shards", names),
                lambda: _stream_seconds("s3://tokens/shards", names, a.seq_len, a.read_ahead, opts),
            ))  # fmt: skip
        try:
            for label, plain, stream in targets:
                plain(), stream()  # warm-up: imports, connections
                ps, ss, order = [], [], []
                for r in range(a.repeats):
                    for kind in (("plain", "stream") if r % 2 == 0 else ("stream", "plain")):
                        secs, nbytes = (plain if kind == "plain" else stream)()
                        assert nbytes == per * a.shards, (kind, nbytes)
                        (ps if kind == "plain" else ss).append(secs)
                        order.append(kind[0])
                ratios = sorted(p / s for p, s in zip(ps, ss))
                floor = _iteration_floor(per * a.shards // (a.seq_len * 2), a.seq_len)
                p, s_ = statistics.median(ps), statistics.median(ss)
                print(
                    f"{label}: {mib:.0f} MiB in {a.shards} shards, seq_len {a.seq_len}: plain {mib / p:.0f} MiB/s, "
                    f"stream {mib / s_:.0f} MiB/s (medians); ratio per repeat min {ratios[0]:.2f}x / median "
                    f"{statistics.median(ratios):.2f}x / max {ratios[-1]:.2f}x over {a.repeats} repeats; "
                    f"order {''.join(order)}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
                    f"the floor of any per-sequence iterator (views of an in-memory tensor, no I/O): "
                    f"{floor * 1e6 / (per * a.shards // (a.seq_len * 2)):.2f} us/sequence, so at most "
                    f"{p / (p + floor):.2f}x of this plain read",
                    flush=True,
                )
        finally:
            if server is not None:
                server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
