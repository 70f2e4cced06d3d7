"""The client CPU one S3 GET costs, apart from the bytes it moves: why ``TokenStream`` fetches
several blocks per request on remote stores (``goodput_ckpt/data/tokens.py``,
``_BLOCKS_PER_REQUEST``).

Starts SeaweedFS on 127.0.0.1 (the recipe of ``tests/helpers/s3.py``), stores one small object,
and times ``--requests`` ranged GETs of 16 bytes, per repeat, through boto3's ``get_object`` and
through this project's ``S3Source.read_into`` (``open_store``), in a rotating order. Prints the
client CPU (process time) and wall time per request, min / median / max over ``--repeats``.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/probe_s3_request_cost.py --requests 200 --repeats 5``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the SeaweedFS recipe


def main(argv: list[str]) -> int:
    import boto3
    from helpers.s3 import SeaweedServer, s3_env

    from goodput_ckpt.storage import open_store

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    os.environ.update(s3_env())
    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedServer(Path(tmp, "weed"))
        try:
            client = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1")
            client.create_bucket(Bucket="probe")
            client.put_object(Bucket="probe", Key="k", Body=b"x" * 4096)
            opts = {"endpoint_url": server.url, "addressing_style": "path", "region": "us-east-1"}
            src = open_store("s3://probe", opts).open_source("k")
            buf = bytearray(16)
            methods = {
                "boto3 get_object": lambda: client.get_object(Bucket="probe", Key="k", Range="bytes=0-15")[
                    "Body"
                ].read(),
                "S3Source.read_into": lambda: src.read_into(0, [buf]),
            }
            for fn in methods.values():  # warm the connection pools
                for _ in range(20):
                    fn()
            names = list(methods)
            cpu: dict[str, list[float]] = {n: [] for n in names}
            wall: dict[str, list[float]] = {n: [] for n in names}
            for r in range(a.repeats):
                for name in names[r % 2 :] + names[: r % 2]:
                    c0, t0 = time.process_time(), time.perf_counter()
                    for _ in range(a.requests):
                        methods[name]()
                    cpu[name].append((time.process_time() - c0) / a.requests * 1e3)
                    wall[name].append((time.perf_counter() - t0) / a.requests * 1e3)
        finally:
            server.stop()
    print(
        f"{a.requests} GETs of 16 bytes per repeat, {a.repeats} repeats, order alternating; load average {os.getloadavg()[0]:.2f}"
    )
    for name in names:
        c, w = sorted(cpu[name]), sorted(wall[name])
        print(
            f"  {name:20s} client CPU ms/GET min {c[0]:.2f} / median {statistics.median(c):.2f} / max {c[-1]:.2f}; "
            f"wall ms/GET median {statistics.median(w):.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
