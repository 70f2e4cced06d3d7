"""What our S3 part uploads do differently from the TransferManager, one difference at a time
(issue 21, a diagnostic; not a figure of the library).

Starts SeaweedFS on 127.0.0.1 (``tests/helpers/s3.py``) and uploads the same ``--size`` bytes as
one object per method (the tensor bytes of ``bench_s3.py``'s synthetic state), in an order rotating per repeat, without DCP around it. Each method
changes one thing against its neighbour:

- ``ours``: the whole save, ``dcp.save`` with ``CheckpointWriter`` (as ``bench_s3.py``'s ``ours``:
  DCP's planning, the commit-record checks, the multipart upload, the commit);
- ``tm-crc``: ``bench_s3.py``'s TransferManager with our integrity scheme (8 MiB parts, 16 in
  flight, a CRC-32 header per part computed by botocore, bodies unsigned): the reference;
- ``sink``: our store's upload path exactly (``S3Store.open_sink`` + ``write_hashed`` from 4
  threads, each chunk copied into a part body with blake3 and CRC-32 in the same pass);
- ``sink-nohash``: the same with no blake3 (the hash's share);
- ``sink-16m`` / ``sink-32m``: the same with 16 / 32 MiB chunks = parts (fewer requests);
- ``mp-fill``: plain ``upload_part`` calls from 16 threads on our store's client, each thread
  copying its part into a body with blake3 and CRC-32 first (the sink's per-byte work without
  the sink: its semaphore, its 4 filler threads, its retry wrapper);
- ``mp-nocopy``: as ``mp-fill``, but the body is the source's own memory (a ``memoryview``, sent
  with parameter validation off), hashed and CRC-summed in place: what the copy costs;
- ``mp-pre``: ``upload_part`` of bodies filled and CRC-summed before the clock: what is left
  with no per-byte client work (the multipart counterpart of ``bench_s3.py``'s ``raw``);
- ``mp-pre-file``: as ``mp-pre`` with file-like bodies (``BytesIO``), as the TransferManager
  sends them: an ``Expect: 100-continue`` round trip and 128 KiB sends per part;
- ``mp-pre-c8`` / ``mp-pre-16m``: ``mp-pre`` with 8 in flight / 16 MiB parts;
- ``raw``: ``bench_s3.py``'s ``raw`` (8 MiB ``PutObject``s, precomputed, 16 threads).

Per method: wall seconds (min / median / max over repeats), the medians of this process's CPU
seconds (the client) and of the server's (``/proc/PID/stat`` of the weed process, which runs
master, volume, filer and S3 gateway in one process); ``floor``: (client + server CPU) / CPUs,
the least time the upload can take on this machine when nothing else runs; ``busy``: the share
of the machine's CPU time that client and server used during the upload (below 1: idle CPU, or
time taken by other processes); then per-repeat ratios to ``tm-crc`` of the time and of the
CPU seconds, client and server together (> 1: less than the TransferManager).

Run: ``flock /tmp/bench.lock env PYTHONPATH=. .venv/bin/python benchmarks/probe_s3_parts.py
--size 512MiB --repeats 5 --methods tm-crc,sink,mp-fill,mp-pre``
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import blake3  # noqa: E402
from bench_s3 import Env, boto_client, raw_requests, remove_prefix, tensors  # noqa: E402
from helpers.s3 import SeaweedServer, s3_env  # noqa: E402

from goodput_ckpt.cli._output import parse_size  # noqa: E402
from goodput_ckpt.storage._s3_bodies import b64, crc32, fill  # noqa: E402
from goodput_ckpt.storage._s3_client import make_client  # noqa: E402
from goodput_ckpt.storage.s3 import S3Config, S3Store  # noqa: E402
from goodput_ckpt.tools.measure._bench_state import make_state  # noqa: E402

warnings.filterwarnings("ignore")
MiB = 1 << 20
BUCKET = "probe"
DEFAULT_METHODS = "ours,tm-crc,sink,sink-nohash,sink-16m,mp-fill,mp-nocopy,mp-pre,mp-pre-file,raw"


def server_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (the server)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sink_method(env: Env, data: memoryview, chunk: int, hash_: bool) -> Callable[[str], None]:
    store = S3Store(f"s3://{BUCKET}", S3Config(endpoint_url=env.url, addressing_style="path", region="us-east-1"))

    def save(prefix: str) -> None:
        sink = store.open_sink(f"{prefix}/blob", part_size=chunk)

        def one(off: int) -> None:
            sink.write_hashed(off, [data[off : off + chunk]], blake3.blake3() if hash_ else None)

        with ThreadPoolExecutor(4) as pool:  # the DCP writer's default thread_count
            list(pool.map(one, range(0, len(data), chunk)))
        sink.close()

    return save


def multipart_method(env: Env, data: memoryview, part: int, conc: int, body: str) -> Callable[[str], None]:
    """``upload_part`` from ``conc`` threads; ``body``: ``fill`` (copy + blake3 + CRC per part, in
    the uploading thread), ``nocopy`` (blake3 + CRC of the source, sent as a memoryview),
    ``pre`` (bytearrays and CRCs made before the clock) or ``pre-file`` (the same as BytesIO)."""
    cfg = S3Config(endpoint_url=env.url, addressing_style="path", region="us-east-1")
    client = make_client(cfg, f"s3://{BUCKET}")
    if body == "nocopy":  # botocore's validator takes no memoryview; the request itself does
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=env.url,
            region_name="us-east-1",
            config=client.meta.config.merge(Config(parameter_validation=False)),
        )
    offsets = list(range(0, len(data), part))
    pre: list = []
    pre_crc: list[str] = []
    if body.startswith("pre"):
        for o in offsets:
            b = bytearray(data[o : o + part])
            pre.append(b)
            pre_crc.append(b64(crc32(b)))
    spare: list[bytearray] = []  # reused fill bodies, as the store's BODIES
    lock = threading.Lock()

    def save(prefix: str) -> None:
        key = f"{prefix}/blob"
        uid = client.create_multipart_upload(Bucket=BUCKET, Key=key, ChecksumAlgorithm="CRC32")["UploadId"]

        def put(i: int) -> dict:
            o = offsets[i]
            if body == "fill":
                with lock:
                    b = spare.pop() if spare else bytearray(min(part, len(data) - o))
                if len(b) != min(part, len(data) - o):
                    b = bytearray(min(part, len(data) - o))
                crc = b64(fill([data], o, o + len(b), b, blake3.blake3(), True))
            elif body == "nocopy":
                b = data[o : o + part]
                blake3.blake3(b)
                crc = b64(crc32(b))
            else:
                b = pre[i] if body == "pre" else io.BytesIO(pre[i])
                crc = pre_crc[i]
            r = client.upload_part(Bucket=BUCKET, Key=key, UploadId=uid, PartNumber=i + 1, Body=b, ChecksumCRC32=crc)
            if body == "fill":
                with lock:
                    spare.append(b)
            return {"PartNumber": i + 1, "ETag": r["ETag"], "ChecksumCRC32": crc}

        with ThreadPoolExecutor(conc) as pool:
            parts = list(pool.map(put, range(len(offsets))))
        client.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=uid, MultipartUpload={"Parts": parts})

    return save


def tm_crc_method(env: Env) -> Callable[[str], None]:
    from boto3.s3.transfer import TransferConfig

    client = boto_client(env, tuned=True, crc=True)
    config = TransferConfig(max_concurrency=16, multipart_chunksize=8 * MiB)

    def save(prefix: str) -> None:
        client.upload_fileobj(io.BytesIO(env.raw), BUCKET, f"{prefix}/blob", Config=config)

    return save


def dcp_method(env: Env) -> Callable[[str], None]:
    import torch.distributed.checkpoint as dcp

    from goodput_ckpt import CheckpointWriter

    opts = {"endpoint_url": env.url, "addressing_style": "path", "region": "us-east-1"}

    def save(prefix: str) -> None:
        dcp.save(env.state, storage_writer=CheckpointWriter(f"s3://{BUCKET}/{prefix}", **opts), no_dist=True)

    return save


def make_method(name: str, env: Env, data: memoryview) -> Callable[[str], None]:
    m = 8 * MiB
    table: dict[str, Callable[[], Callable[[str], None]]] = {
        "ours": lambda: dcp_method(env),
        "tm-crc": lambda: tm_crc_method(env),
        "sink": lambda: sink_method(env, data, m, True),
        "sink-nohash": lambda: sink_method(env, data, m, False),
        "sink-16m": lambda: sink_method(env, data, 2 * m, True),
        "sink-32m": lambda: sink_method(env, data, 4 * m, True),
        "mp-fill": lambda: multipart_method(env, data, m, 16, "fill"),
        "mp-nocopy": lambda: multipart_method(env, data, m, 16, "nocopy"),
        "mp-pre": lambda: multipart_method(env, data, m, 16, "pre"),
        "mp-pre-file": lambda: multipart_method(env, data, m, 16, "pre-file"),
        "mp-pre-c8": lambda: multipart_method(env, data, m, 8, "pre"),
        "mp-pre-16m": lambda: multipart_method(env, data, 2 * m, 16, "pre"),
        "raw": lambda: raw_requests(env, BUCKET, "unused")[0],  # its save takes the prefix
    }
    if name not in table:
        raise SystemExit(f"unknown method {name!r}; known: {', '.join(table)}")
    return table[name]()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--size", default="512MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--methods", default=DEFAULT_METHODS)
    a = p.parse_args()
    os.environ.update(s3_env())
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        os.environ.pop(k, None)
    import torch

    st = make_state(parse_size(a.size))
    raw = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for _, t in tensors(st.nested))
    n = len(raw)
    data = memoryview(bytearray(raw))  # the "tensor memory" the sink methods read from
    tmp = Path(tempfile.mkdtemp(prefix="probe-s3-parts-"))
    server = SeaweedServer(tmp)
    env = Env(server.url, f"http://127.0.0.1:{server.master_port}", "", st.nested, n, raw)
    methods = [m for m in a.methods.split(",") if m]
    wall: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    scpu: dict[str, list[float]] = defaultdict(list)
    orders = []
    load0 = os.getloadavg()
    try:
        boto_client(env, tuned=True).create_bucket(Bucket=BUCKET)
        saves = {m: make_method(m, env, data) for m in methods}
        for m in methods:  # one untimed warm-up each: clients, connections, kept bodies
            saves[m](f"{m}-warm")
            remove_prefix(env, BUCKET, f"{m}-warm")
        for rep in range(a.repeats):
            order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
            orders.append(order)
            for m in order:
                prefix = f"{m}-{rep}"
                s0, c0, t0 = server_cpu(server.proc.pid), time.process_time(), time.perf_counter()
                saves[m](prefix)
                wall[m].append(time.perf_counter() - t0)
                cpu[m].append(time.process_time() - c0)
                time.sleep(0.3)  # the server finishes its bookkeeping of the last request
                scpu[m].append(server_cpu(server.proc.pid) - s0)
                remove_prefix(env, BUCKET, prefix)
            print(
                f"repeat {rep + 1}: " + ", ".join(f"{m} {wall[m][-1]:.2f}s" for m in order), file=sys.stderr, flush=True
            )
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"{n / MiB:.0f} MiB, {a.repeats} repeats; load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs; order: " + " | ".join(",".join(o) for o in orders)
    )
    print(
        f"{'method':<13}{'MiB/s':>7}{'wall s min/med/max':>22}{'client cpu':>11}{'server cpu':>11}{'floor s':>8}"
        f"{'busy':>6}{'time vs tm-crc':>17}{'cpu vs tm-crc':>16}"
    )
    ncpu = os.cpu_count() or 1
    for m in methods:
        w = wall[m]
        total = [c + sc for c, sc in zip(cpu[m], scpu[m])]
        cells = []
        for mine, ref in (
            (w, wall.get("tm-crc")),
            (total, [c + sc for c, sc in zip(cpu["tm-crc"], scpu["tm-crc"])] if "tm-crc" in cpu else None),
        ):
            r = [t / x for x, t in zip(mine, ref)] if ref else None
            cells.append(f"{min(r):.2f}/{statistics.median(r):.2f}/{max(r):.2f}" if r else "-")
        print(
            f"{m:<13}{n / MiB / statistics.median(w):>7.0f}{f'{min(w):.2f}/{statistics.median(w):.2f}/{max(w):.2f}':>22}"
            f"{statistics.median(cpu[m]):>11.2f}{statistics.median(scpu[m]):>11.2f}{statistics.median(total) / ncpu:>8.2f}"
            f"{statistics.median(t / (ncpu * x) for t, x in zip(total, w)):>6.2f}{cells[0]:>17}{cells[1]:>16}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
