"""Where one S3 save's time goes (issue 21, a diagnostic; not a figure of the library).

Starts SeaweedFS on 127.0.0.1 (tests/helpers/s3.py) and, per repeat in rotating order, saves the
synthetic state with ``CheckpointWriter`` (``ours``), the same with blake3 replaced by a no-op
(``ours-nohash``: a diagnostic only, ``benchmarks/bench_local.py``'s patch), and the ``raw`` PUTs
of ``bench_s3.py`` (the server's limit for these bytes). For ``ours`` it times, inside the save:

- ``pre``: before the first chunk is written: DCP planning, the stale-upload LIST and the
  commit-record GET (``clear_or_refuse_existing``, timed on its own as ``clear``);
- ``parts``: from the first chunk to the last part's response (the bulk);
- ``complete``: CompleteMultipartUpload and its size check (HEAD);
- ``commit``: the manifest (HEAD + conditional PUT) and DCP's finish;

and prints each as min/median/max seconds, with the load average and the order.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import torch.distributed.checkpoint as dcp  # noqa: E402
from bench_local import no_save_hashing  # noqa: E402
from bench_s3 import Env, raw_requests, tensors  # noqa: E402
from helpers.s3 import SeaweedServer, s3_env  # noqa: E402

import goodput_ckpt.dcp.writer as wr  # noqa: E402
from goodput_ckpt import CheckpointWriter  # noqa: E402
from goodput_ckpt.cli._output import parse_size  # noqa: E402
from goodput_ckpt.storage import _s3_upload as up  # noqa: E402
from goodput_ckpt.tools.measure._bench_state import make_state  # noqa: E402

warnings.filterwarnings("ignore")
MiB = 1 << 20
marks: dict[str, float] = {}


def mark(name: str, first: bool = True) -> None:
    if not first or name not in marks:
        marks[name] = time.perf_counter()


def wrap(cls, attr: str, before: str | None, after: str | None, first_before: bool = True) -> None:
    orig = getattr(cls, attr)

    def f(*a, **k):
        if before:
            mark(before, first_before)
        try:
            return orig(*a, **k)
        finally:
            if after:
                mark(after, first=False)

    setattr(cls, attr, f)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="512MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--methods",
        default="ours,ours-nohash,raw",
        help="also ours-t8 (thread_count=8) and ours-mc32 (max_concurrency=32)",
    )
    a = p.parse_args()
    os.environ.update(s3_env())
    wrap(wr.CheckpointWriter, "_clear_or_refuse_existing", "clear0", "clear1")
    wrap(up.S3Sink, "write_hashed", "first_chunk", None)
    wrap(up.S3Sink, "_upload_part", None, "last_part")
    wrap(up.S3Sink, "_complete", "complete0", "complete1")
    wrap(wr.CheckpointWriter, "_commit", "commit0", "commit1")
    st = make_state(parse_size(a.size))
    raw = b"".join(t.contiguous().view(__import__("torch").uint8).numpy().tobytes() for _, t in tensors(st.nested))
    data = Path(tempfile.mkdtemp(prefix="probe-s3-"))
    server = SeaweedServer(data)
    env = Env(server.url, f"http://127.0.0.1:{server.master_port}", "", st.nested, st.nbytes, raw)
    opts = {"endpoint_url": env.url, "addressing_style": "path", "region": "us-east-1"}
    out: dict[str, list[float]] = defaultdict(list)
    methods = a.methods.split(",")
    variants = {"ours": {}, "ours-nohash": {}, "ours-t8": {"thread_count": 8}, "ours-mc32": {"max_concurrency": 32}}
    orders = []
    load0 = os.getloadavg()
    try:
        import boto3

        boto3.client("s3", endpoint_url=env.url, region_name="us-east-1").create_bucket(Bucket="probe")
        for rep in range(a.repeats):
            order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
            orders.append(order)
            for m in order:
                prefix = f"{m}-{rep}"
                marks.clear()
                if m == "raw":
                    save, _ = raw_requests(env, "probe", prefix)
                else:

                    def save(m=m, prefix=prefix):
                        w = CheckpointWriter(f"s3://probe/{prefix}", **opts, **variants[m])
                        if m == "ours-nohash":
                            with no_save_hashing():
                                dcp.save(st.nested, storage_writer=w, no_dist=True)
                        else:
                            dcp.save(st.nested, storage_writer=w, no_dist=True)

                c0, t0 = time.process_time(), time.perf_counter()
                save()
                t1 = time.perf_counter()
                out[f"{m} total"].append(t1 - t0)
                out[f"{m} cpu"].append(time.process_time() - c0)
                if m == "ours":
                    out["ours clear"].append(marks["clear1"] - marks["clear0"])
                    out["ours pre"].append(marks["first_chunk"] - t0)
                    out["ours parts"].append(marks["last_part"] - marks["first_chunk"])
                    out["ours complete"].append(marks["complete1"] - marks["complete0"])
                    out["ours last part -> complete"].append(marks["complete0"] - marks["last_part"])
                    out["ours commit"].append(marks["commit1"] - marks["commit0"])
                    out["ours after commit"].append(t1 - marks["commit1"])
                print(f"rep {rep + 1} {m} {t1 - t0:.3f} s", flush=True)
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)
    print(f"\n{st.nbytes / MiB:.0f} MiB, {a.repeats} repeats; load average {load0} -> {os.getloadavg()}")
    print("order: " + " | ".join(", ".join(o) for o in orders))
    for k, v in out.items():
        print(f"{k:<28} {min(v):7.3f} {statistics.median(v):7.3f} {max(v):7.3f}  (min/median/max s)")
    for ref in [x for x in methods if x != "ours"]:
        r = [b / a_ for a_, b in zip(out["ours total"], out[f"{ref} total"])]
        print(f"ours vs {ref}: {min(r):.2f}/{statistics.median(r):.2f}/{max(r):.2f}x (per-repeat, min/median/max)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
