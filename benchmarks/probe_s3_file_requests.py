"""S3 requests that grow with the number of files in a step, before and after issue 37:
deleting a step (retention) and checking every data file's size (restore, verify, inspect).

Starts moto (or SeaweedFS) on 127.0.0.1 (the recipes of ``tests/helpers/s3.py``), plants a step
of ``--files`` data files plus a commit record under a manager root, and counts, on the store's
real boto3 client (``helpers.s3_requests.RequestCounter``):

- *delete a step, before*: what ``retention.delete_step`` ran before issue 37, one
  ``store.delete`` per file, commit record first (the loop is repeated here verbatim);
- *delete a step, after*: ``retention.delete_step`` now: the record alone, then
  ``delete_files`` (``DeleteObjects``, 1,000 keys a request);
- *file sizes, before*: what ``file_problems`` ran before, one ``store.size`` (``HeadObject``)
  per file;
- *file sizes, after*: ``file_sizes`` (one listing of the step, 1,000 sizes a page);
- *scan the root*: ``scan_steps`` (unchanged: every page of the root's listing).

Each row prints the requests by operation, the wall time (min / median / max over
``--repeats``) and the time under a latency model of ``--latency-ms`` per request (these
requests are sequential, so the model is requests x latency).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/probe_s3_file_requests.py --files 2048 --repeats 3``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the servers, the counter

BUCKET = "goodput-probe"


def main(argv: list[str]) -> int:
    import boto3
    from helpers.s3 import MotoServer, SeaweedServer, s3_env
    from helpers.s3_requests import RequestCounter, by_operation

    from goodput_ckpt.format.manifest import MANIFEST_NAME
    from goodput_ckpt.manager.retention import delete_step, scan_steps
    from goodput_ckpt.manager.step_layout import step_dir_name
    from goodput_ckpt.storage import open_store
    from goodput_ckpt.storage.bulk import file_sizes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=2048, help="data files in the step (one per rank)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--server", choices=("moto", "seaweedfs"), default="moto")
    ap.add_argument("--latency-ms", type=float, default=10.0)
    a = ap.parse_args(argv)
    os.environ.update(s3_env())
    names = [f"rank{r:05d}-00.0123456789ab.bin" for r in range(a.files)]
    step = 1
    rows: dict[str, list[tuple[dict[str, int], float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedServer(Path(tmp, "weed")) if a.server == "seaweedfs" else MotoServer()
        try:
            client = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1")
            client.create_bucket(Bucket=BUCKET)
            counter = RequestCounter()
            opts = {
                "endpoint_url": server.url,
                "addressing_style": "path",
                "region": "us-east-1",
                "session": counter.session(),
            }
            root = open_store(f"s3://{BUCKET}/root", opts)
            step_store = open_store(f"s3://{BUCKET}/root/{step_dir_name(step)}", opts)

            def plant() -> None:
                with ThreadPoolExecutor(16) as pool:
                    keys = [f"root/{step_dir_name(step)}/{n}" for n in [*names, MANIFEST_NAME]]
                    list(pool.map(lambda k: client.put_object(Bucket=BUCKET, Key=k, Body=b"d"), keys))

            def delete_before() -> None:  # retention.delete_step before issue 37, verbatim
                d = step_dir_name(step)
                for f in sorted([*names, MANIFEST_NAME], key=lambda f: f != MANIFEST_NAME):
                    root.delete(f"{d}/{f}")

            def sizes_before() -> None:  # file_problems before issue 37: one size() per file
                for n in names:
                    assert step_store.size(n) == 1

            def sizes_after() -> None:
                assert set(file_sizes(step_store, names).values()) == {1}

            cases: list[tuple[str, Callable[[], Any], bool]] = [
                ("file sizes, before (HeadObject each)", sizes_before, False),
                ("file sizes, after (file_sizes)", sizes_after, False),
                ("scan the root (scan_steps)", lambda: scan_steps(root), False),
                ("delete a step, before (DeleteObject each)", delete_before, True),
                ("delete a step, after (delete_step)", lambda: delete_step(root, step, [*names, MANIFEST_NAME]), True),
            ]
            planted = False
            for rep in range(a.repeats):
                order = cases[rep % len(cases) :] + cases[: rep % len(cases)]  # rotate: times may drift
                for label, fn, consumes in order:
                    if not planted:
                        plant()
                    planted = not consumes
                    counter.take()
                    t0 = time.perf_counter()
                    fn()
                    wall = time.perf_counter() - t0
                    rows.setdefault(label, []).append((by_operation(counter.take()), wall))
                print(f"repeat {rep + 1}/{a.repeats} done, load average {os.getloadavg()[0]:.1f}", flush=True)
        finally:
            server.stop()
    print(
        f"\n{a.files} data files + 1 commit record, server {a.server}, {os.cpu_count()} CPUs; "
        f"model: {a.latency_ms:g} ms per request, sequential"
    )
    print("| operation | requests | by operation | wall s (min / median / max) | modelled s |")
    print("|---|---|---|---|---|")
    for label, _, _ in cases:
        ops = rows[label][0][0]
        assert all(r[0] == ops for r in rows[label]), f"{label}: counts differ between repeats"
        walls = sorted(w for _, w in rows[label])
        total = sum(ops.values())
        by = ", ".join(f"{op} {n}" for op, n in ops.items())
        print(
            f"| {label} | {total} | {by} | {walls[0]:.2f} / {statistics.median(walls):.2f} / {walls[-1]:.2f} "
            f"| {total * a.latency_ms / 1000:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
