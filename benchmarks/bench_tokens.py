"""TokenStream read throughput against a plain sequential read of the same shard files.

Writes ``--shards`` files of random ``uint16`` tokens (``--size`` in all), then times, in a
rotating order per repeat:

- ``plain``: each file read start to end in 8 MiB ``readinto`` calls (local), or one streaming
  ``GetObject`` per file read in 8 MiB pieces (S3, boto3): what a loader that does nothing but
  read would cost;
- ``seq``: every sequence of a ``TokenStream`` (``num_workers=0``, one rank) iterated in
  Python, ``--seq-len`` tokens each, read in blocks of 4 MiB (local) or 8 MiB (S3) through
  ``open_store``, ``--read-ahead`` blocks read ahead (default: the stream's, 4 locally and 16 on
  S3), ``--per-request`` blocks per request (default: the stream's, 1 locally and 2 on S3);
- ``batch``: the same stream with ``batch_size=--batch-size``: one ``(batch, seq_len)`` tensor
  per item;
- ``plain2`` (``--plain2``, local): the plain read alternating two 8 MiB buffers (what the
  stream did with 8 MiB blocks read in the consumer's thread, ``read_ahead=0``: the caller holds
  the last item of a block when the next is read; hence 4 MiB blocks locally);
- with ``--volume`` (and ``--s3``), the same objects read as files of an ``rclone mount``
  (``--vfs-cache-mode off``, a strict volume): ``plain`` reads each file in 8 MiB ``readinto``
  calls through the mount, the stream opens the mount path (a volume store, the remote defaults);
- ``loader``: the batched stream through ``StatefulDataLoader(batch_size=None, num_workers=0)``,
  as a training loop takes it (the loader's own cost per item included).

Each pass builds a new ``TokenStream`` (as each stretch or epoch does); the idle buffers of the
process's block pool carry over from the pass before, as they do in a training process (the
untimed warm-up pass allocates them). The ratio is plain seconds / method seconds in the same
repeat (1.0: the stream costs nothing over the read); the report gives min/median/max over
repeats, the order the methods ran in, and the load average before and after. Local files are
read cold (each file's pages evicted with ``posix_fadvise(DONTNEED)`` before every timed pass,
as a training job reads shards it has not read yet) and warm (from the page cache, where the
plain read is a memory copy and the stream's Python overhead is most visible): ``--cache``. S3
runs against a SeaweedFS server on 127.0.0.1 (the recipe of ``tests/helpers/s3.py``), which
shares the cores. ``--profile`` prints a cProfile of one pass of each stream method (where the
time goes) instead of timing.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_tokens.py --size 512MiB --shards 4 --repeats 5 --s3``
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the SeaweedFS recipe

from goodput_ckpt.data import TokenStream  # noqa: E402
from goodput_ckpt.tools.measure._bench_scratch import evict_page_cache  # noqa: E402

PIECE = 8 << 20


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * m)
    return int(text)


def _stream_seconds(
    root: str,
    names: list[str],
    seq_len: int,
    ahead: int | None,
    options: dict,
    batch: int | None,
    loader: bool = False,
    block: int | None = None,
    per_request: int | None = None,
) -> tuple[float, int]:
    """Seconds to take every item of a new TokenStream, and the token bytes taken."""
    ds = TokenStream(
        root,
        names,
        seq_len=seq_len,
        dtype="uint16",
        read_ahead=ahead,
        storage_options=options,
        batch_size=batch,
        block=block,
        blocks_per_request=per_request,
    )
    items = ds
    if loader:
        from torchdata.stateful_dataloader import StatefulDataLoader

        items = StatefulDataLoader(ds, batch_size=None, num_workers=0)
    t0, n = time.perf_counter(), 0
    for item in items:
        n += item.numel()
    return time.perf_counter() - t0, n * 2


#: The plain read's buffers: page-aligned (anonymous mmap) and reused across passes. A
#: ``bytearray`` lands wherever malloc puts it; 16 bytes off a 32-byte boundary, the kernel's copy
#: out of the page cache measured 2.4x slower on this machine's AMD EPYC, which made the baseline
#: vary between processes. Two of them for ``plain2``.
_PLAIN_BUFS = [memoryview(mmap.mmap(-1, PIECE)) for _ in range(2)]


def _plain_local(root: Path, names: list[str], nbufs: int = 1) -> tuple[float, int]:
    """Each file start to end in 8 MiB ``readinto`` calls, into one reused buffer (``nbufs`` 2:
    alternating between two, as a stream must when the caller holds the last block's items)."""
    bufs = _PLAIN_BUFS[:nbufs]
    t0, total, k = time.perf_counter(), 0, 0
    for name in names:
        with open(root / name, "rb", buffering=0) as f:
            while (got := f.readinto(bufs[k % nbufs])) > 0:
                total += got
                k += 1
    return time.perf_counter() - t0, total


def _plain_s3(client, bucket: str, prefix: str, names: list[str]) -> tuple[float, int]:
    t0, total = time.perf_counter(), 0
    for name in names:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"]
        for piece in body.iter_chunks(PIECE):
            total += len(piece)
    return time.perf_counter() - t0, total


def _iteration_floor(n: int, seq_len: int) -> float:
    """Seconds to iterate ``n`` sequence views of an in-memory tensor (median of 3), unbound 8 MiB
    at a time as the stream does: what any iterable yielding one tensor per sequence costs in
    Python before it reads a byte. (Unbinding all ``n`` rows at once, as this did before, holds
    ``n`` views alive together and measured about twice the per-view cost.)"""
    import torch

    rows = torch.zeros((n, seq_len), dtype=torch.uint16)
    chunk = max(1, (8 << 20) // (seq_len * 2))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for block in rows.split(chunk):
            for _row in block.unbind(0):
                pass
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _profile(label: str, methods: dict) -> None:
    """One pass of each stream method under cProfile: where the time goes (reproducible)."""
    import cProfile
    import pstats

    for name, fn in methods.items():
        if name == "plain":
            continue
        fn()  # warm-up
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        print(f"--- {label}: {name} (tottime, top 10)", flush=True)
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(10)


def _time(label: str, methods: dict, repeats: int, mib: float, total: int, seq_len: int) -> None:
    """Every method once per repeat, in a rotating order; ratios against plain in the same repeat."""
    names = list(methods)
    for fn in methods.values():
        fn()  # warm-up: imports, connections, the block pool's buffers
    load0 = os.getloadavg()
    secs: dict[str, list[float]] = {n: [] for n in names}
    order = []
    for r in range(repeats):
        rotated = names[r % len(names) :] + names[: r % len(names)]
        for name in rotated:
            t, nbytes = methods[name]()
            assert nbytes == total, (name, nbytes, total)
            secs[name].append(t)
        order.append("".join("P" if n == "plain2" else n[0] for n in rotated))
    load1 = os.getloadavg()
    plain = statistics.median(secs["plain"])
    floor = _iteration_floor(total // (seq_len * 2), seq_len)
    print(
        f"{label}: {mib:.0f} MiB, seq_len {seq_len}: plain {mib / plain:.0f} MiB/s (median); "
        f"order {' '.join(order)} (p plain, P plain2, s seq, b batch, l loader); load average "
        f"{load0[0]:.2f} before, {load1[0]:.2f} after, on {os.cpu_count()} CPUs",
        flush=True,
    )
    for name in names[1:]:
        ratios = sorted(p / m for p, m in zip(secs["plain"], secs[name]))
        print(
            f"  {name:7s} {mib / statistics.median(secs[name]):6.0f} MiB/s (median); ratio to plain per repeat "
            f"min {ratios[0]:.2f}x / median {statistics.median(ratios):.2f}x / max {ratios[-1]:.2f}x over {repeats}",
            flush=True,
        )
    n = total // (seq_len * 2)
    print(
        f"  floor of any per-sequence iterator (views of an in-memory tensor, no I/O): "
        f"{floor * 1e6 / n:.2f} us/sequence, so at most {plain / (plain + floor):.2f}x of this plain read",
        flush=True,
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=32, help="sequences per item in the batch and loader methods")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--block",
        type=int,
        default=None,
        help="TokenStream block (sequences per read; default: 4 MiB worth locally, 8 MiB on S3)",
    )
    ap.add_argument(
        "--read-ahead", type=int, default=None, help="TokenStream read_ahead (default: the stream's, by store)"
    )
    ap.add_argument(
        "--per-request", type=int, default=None, help="TokenStream blocks_per_request (default: the stream's, by store)"
    )
    ap.add_argument("--s3", action="store_true", help="also against SeaweedFS on 127.0.0.1")
    ap.add_argument(
        "--volume",
        action="store_true",
        help="with --s3: also through an rclone mount of that bucket (--vfs-cache-mode off)",
    )
    ap.add_argument("--no-local", action="store_true", help="skip the local targets")
    ap.add_argument(
        "--cache",
        choices=("cold", "warm", "both"),
        default="both",
        help="local files: evicted before each pass, cached, or both",
    )
    ap.add_argument("--plain2", action="store_true", help="local: also a plain read alternating two 8 MiB buffers")
    ap.add_argument(
        "--profile", action="store_true", help="print a cProfile of one pass per stream method instead of timing"
    )
    a = ap.parse_args(argv)
    per = _size(a.size) // a.shards // (a.seq_len * 2) * (a.seq_len * 2)
    total = per * a.shards
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp, "shards")
        root.mkdir()
        names = [f"shard{k:03d}.bin" for k in range(a.shards)]
        for name in names:
            (root / name).write_bytes(rng.integers(0, 50257, per // 2, dtype=np.uint16).tobytes())

        def methods(plain, src: str, opts: dict, evict: bool | None) -> dict:
            def cold(fn):
                def run():
                    if evict:  # None: not a local target
                        for name in names:
                            evict_page_cache(str(root / name))
                    return fn()

                return run

            extra = {"plain2": cold(lambda: _plain_local(root, names, 2))} if a.plain2 and evict is not None else {}
            return {
                "plain": cold(plain),
                **extra,
                "seq": cold(
                    lambda: _stream_seconds(
                        src, names, a.seq_len, a.read_ahead, opts, None, block=a.block, per_request=a.per_request
                    )
                ),
                "batch": cold(
                    lambda: _stream_seconds(
                        src,
                        names,
                        a.seq_len,
                        a.read_ahead,
                        opts,
                        a.batch_size,
                        block=a.block,
                        per_request=a.per_request,
                    )
                ),
                "loader": cold(
                    lambda: _stream_seconds(
                        src, names, a.seq_len, a.read_ahead, opts, a.batch_size, True, a.block, a.per_request
                    )
                ),
            }

        targets = []
        if not a.no_local:
            for cache in ("cold", "warm") if a.cache == "both" else (a.cache,):
                targets.append(
                    (f"local ({cache})", methods(lambda: _plain_local(root, names), str(root), {}, cache == "cold"))
                )
        server = mount = None
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
            targets.append(
                ("s3", methods(lambda: _plain_s3(client, "tokens", "shards", names), "s3://tokens/shards", opts, None))
            )
            if a.volume:  # the same objects as files of a strict FUSE mount (a volume store)
                from helpers.volume import RcloneMount

                mount = RcloneMount(server.url, "tokens", Path(tmp, "mnt"), Path(tmp, "rclone"))
                vroot = mount.path / "shards"
                targets.append(("volume (rclone)", methods(lambda: _plain_local(vroot, names), str(vroot), {}, None)))
        print(
            f"{total / (1 << 20):.0f} MiB in {a.shards} shards, seq_len {a.seq_len} (uint16), batch_size {a.batch_size}, "
            f"block {a.block or 'the default (4 MiB local, 8 MiB S3)'}, read_ahead {'the default (4 local, 16 S3)' if a.read_ahead is None else a.read_ahead}, "
            f"blocks_per_request {'the default (1 local, 2 S3)' if a.per_request is None else a.per_request}",
            flush=True,
        )
        try:
            for label, ms in targets:
                if a.profile:
                    _profile(label, ms)
                else:
                    _time(label, ms, a.repeats, total / (1 << 20), total, a.seq_len)
        finally:
            if mount is not None:
                mount.stop()
            if server is not None:
                server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
