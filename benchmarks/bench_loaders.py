"""Token loader throughput: our TokenStream against MosaicML Streaming and s3torchconnector (issue 34).

The same random ``uint16`` tokens (``--size`` in ``--shards`` shard files, fixed seed), one rank,
no worker processes, every sequence of ``--seq-len`` tokens taken as a tensor, in every method:

- ``ours``: ``goodput_ckpt.data.TokenStream`` over the raw shard files (local directory, or
  ``s3://`` through SeaweedFS), at its defaults;
- ``streaming``: MosaicML Streaming's ``StreamingDataset`` (``shuffle=False``, ``batch_size=--batch-size``,
  which also sets how far it prepares samples ahead: ``predownload`` = 8 x batch; with
  ``batch_size=1`` its iterator sleeps 7 ms every 8 samples and measured ~3 MiB/s) over MDS shards
  written by its ``MDSWriter`` from the same tokens (one ``ndarray:uint16:SEQ`` column, one sample
  per sequence, shards of the same size): locally from the MDS directory, on S3 with
  ``remote=s3://...`` and a fresh, empty local cache per pass (it downloads each shard, then reads
  it: what a job that has not read the data yet does), ``S3_ENDPOINT_URL`` pointing at the server;
  each sample's array becomes a tensor (``torch.from_numpy``);
- ``s3tc`` (S3 only): s3torchconnector's ``S3IterableDataset.from_prefix`` over the raw shards,
  each object read whole and cut into sequences (its reader has no notion of a record).

Local passes read cold: every file's pages are evicted (``posix_fadvise(DONTNEED)``) before each
pass. Each pass builds a new dataset; one untimed pass per method first (imports, connections).
Order rotates per repeat; figures are min/median/max over ``--repeats`` of (best peer's seconds /
our seconds) within the same repeat, where the best peer is the fastest one in that repeat.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_loaders.py --size 128MiB --shards 4 --repeats 3``
(peers: ``pip install -e '.[bench]'``; SeaweedFS: the ``test`` extra).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the SeaweedFS recipe

from goodput_ckpt.cli._output import parse_size  # noqa: E402
from goodput_ckpt.data import TokenStream  # noqa: E402
from goodput_ckpt.tools.measure._bench_measure import spread_of as _stats  # noqa: E402
from goodput_ckpt.tools.measure._bench_scratch import evict_page_cache  # noqa: E402

warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
MiB = 1 << 20
Pass = Callable[[], int]  # one pass over every sequence; returns the token bytes taken


def import_streaming() -> Any:
    """``import streaming`` without its vision and multimodal subpackages.

    ``streaming/__init__`` imports ``streaming.vision``, which needs torchvision; the only
    torchvision on the package index here is a CUDA build that fails to load against this CPU
    torch. Token loading uses neither, so both are stood in for by empty modules when
    torchvision does not import."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        for name in ("streaming.vision", "streaming.multimodal"):
            if name not in sys.modules:
                mod = types.ModuleType(name)
                mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
                sys.modules[name] = mod
    import streaming

    return streaming


def write_mds(out: Path, tokens: list[np.ndarray], seq_len: int, shard_bytes: int) -> None:
    streaming = import_streaming()
    with streaming.MDSWriter(
        out=str(out), columns={"tokens": f"ndarray:uint16:{seq_len}"}, size_limit=shard_bytes + (1 << 16)
    ) as w:
        for shard in tokens:
            for row in shard.reshape(-1, seq_len):
                w.write({"tokens": row})


def ours(root: str, names: list[str], seq_len: int, opts: dict) -> Pass:
    def run() -> int:
        n = 0
        for seq in TokenStream(root, names, seq_len=seq_len, dtype="uint16", storage_options=opts):
            n += seq.numel()
        return n * 2

    return run


def streaming_pass(local: str, remote: str | None, seq_len: int, scratch: Path, batch: int) -> Pass:
    streaming = import_streaming()

    def run() -> int:
        cache = None
        if remote is not None:
            cache = Path(tempfile.mkdtemp(dir=scratch, prefix="mds-cache-"))
        ds = streaming.StreamingDataset(local=str(cache or local), remote=remote, shuffle=False, batch_size=batch)
        n = 0
        try:
            for sample in ds:
                t = torch.from_numpy(sample["tokens"])
                assert t.numel() == seq_len
                n += t.numel()
        finally:
            del ds
            streaming.base.util.clean_stale_shared_memory()
            if cache is not None:
                shutil.rmtree(cache, ignore_errors=True)
        return n * 2

    return run


def s3tc_pass(url: str, prefix: str, seq_len: int) -> Pass:
    from s3torchconnector import S3ClientConfig, S3IterableDataset

    def run() -> int:
        ds = S3IterableDataset.from_prefix(
            prefix, region="us-east-1", endpoint=url, s3client_config=S3ClientConfig(force_path_style=True)
        )
        n = 0
        for reader in ds:
            data = bytearray(reader.read())
            for seq in torch.frombuffer(data, dtype=torch.uint16).view(-1, seq_len).unbind(0):
                n += seq.numel()
        return n * 2

    return run


def timed(label: str, methods: dict[str, Pass], repeats: int, total: int, before: Callable[[], None]) -> dict[str, Any]:
    for fn in methods.values():
        before()
        fn()  # untimed warm-up pass
    secs: dict[str, list[float]] = {m: [] for m in methods}
    order = []
    load0 = os.getloadavg()[0]
    for r in range(repeats):
        k = r % len(methods)
        rotated = list(methods)[k:] + list(methods)[:k]
        order.append(rotated)
        for m in rotated:
            before()
            t0 = time.perf_counter()
            got = methods[m]()
            secs[m].append(time.perf_counter() - t0)
            if got != total:
                raise AssertionError(f"{label} {m}: {got} token bytes, want {total}")
    peers = [m for m in methods if m != "ours"]
    best = [min(secs[p][r] for p in peers) for r in range(repeats)] if peers else []
    rel = {p: [secs[p][r] / secs["ours"][r] for r in range(repeats)] for p in peers}
    out = {
        "order": order,
        "seconds": secs,
        "load_average": [load0, os.getloadavg()[0]],
        "mib_s": {m: total / MiB / statistics.median(s) for m, s in secs.items()},
        "ratio_vs": {p: _stats(v) for p, v in rel.items()},
    }
    if best:
        out["ratio_vs_best_peer"] = _stats([b / o for b, o in zip(best, secs["ours"])])
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    per = parse_size(args.size) // args.shards // (args.seq_len * 2) * (args.seq_len * 2)
    total = per * args.shards
    rng = np.random.default_rng(0)
    report: dict[str, Any] = {
        "bytes": total,
        "shards": args.shards,
        "seq_len": args.seq_len,
        "repeats": args.repeats,
        "batch_size": args.batch_size,
        "cpus": os.cpu_count(),
        "skipped": {},
    }
    try:
        import_streaming()
    except ImportError as e:
        report["skipped"]["streaming"] = f"mosaicml-streaming does not import ({e}): pip install mosaicml-streaming"
    try:
        import s3torchconnector  # noqa: F401
    except ImportError as e:
        report["skipped"]["s3tc"] = f"s3torchconnector does not import ({e}): pip install s3torchconnector"
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        raw, mds = Path(tmp, "raw"), Path(tmp, "mds")
        raw.mkdir()
        names = [f"shard{k:03d}.bin" for k in range(args.shards)]
        tokens = [rng.integers(0, 50257, per // 2, dtype=np.uint16) for _ in names]
        for name, t in zip(names, tokens):
            (raw / name).write_bytes(t.tobytes())
        if "streaming" not in report["skipped"]:
            write_mds(mds, tokens, args.seq_len, per)

        def evict() -> None:
            for d in (raw, mds):
                for f in d.rglob("*"):
                    if f.is_file():
                        evict_page_cache(str(f))

        if "local" in args.targets:
            methods = {"ours": ours(str(raw), names, args.seq_len, {})}
            if "streaming" not in report["skipped"]:
                methods["streaming"] = streaming_pass(str(mds), None, args.seq_len, Path(tmp), args.batch_size)
            report["local"] = timed("local", methods, args.repeats, total, evict)
        if "s3" in args.targets:
            import boto3
            from helpers.s3 import SeaweedServer, s3_env

            os.environ.update(s3_env())
            server = SeaweedServer(Path(tmp, "weed"))
            try:
                os.environ["S3_ENDPOINT_URL"] = server.url  # how Streaming's downloader finds the server
                client = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1")
                client.create_bucket(Bucket="tokens")
                for name in names:
                    client.upload_file(str(raw / name), "tokens", f"raw/{name}")
                for f in sorted(mds.rglob("*")) if mds.exists() else []:
                    if f.is_file():
                        client.upload_file(str(f), "tokens", f"mds/{f.relative_to(mds)}")
                opts = {"endpoint_url": server.url, "addressing_style": "path", "region": "us-east-1"}
                methods = {"ours": ours("s3://tokens/raw", names, args.seq_len, opts)}
                if "streaming" not in report["skipped"]:
                    methods["streaming"] = streaming_pass(
                        "", "s3://tokens/mds", args.seq_len, Path(tmp), args.batch_size
                    )
                if "s3tc" not in report["skipped"]:
                    methods["s3tc"] = s3tc_pass(server.url, "s3://tokens/raw/", args.seq_len)
                report["s3"] = timed("s3", methods, args.repeats, total, lambda: None)
            finally:
                server.stop()
    return report


def print_report(report: dict[str, Any]) -> None:
    print(
        f"{report['bytes'] / MiB:.0f} MiB of uint16 tokens in {report['shards']} shards, seq_len {report['seq_len']}, "
        f"{report['repeats']} repeats, Streaming batch_size {report['batch_size']}, 1 rank, no workers, on {report['cpus']} CPUs"
    )
    for target in ("local", "s3"):
        if target not in report:
            continue
        r = report[target]
        la = r["load_average"]
        print(
            f"{target}: order "
            + " | ".join(", ".join(o) for o in r["order"])
            + f"; load average {la[0]:.2f} before, {la[1]:.2f} after"
        )
        for m, v in r["mib_s"].items():
            print(f"  {m:9s} {v:7.0f} MiB/s (median)")
        for p, s in r["ratio_vs"].items():
            print(f"  ours vs {p:9s} {s['median']:.2f}x (min {s['min']:.2f}, max {s['max']:.2f})")
        if "ratio_vs_best_peer" in r:
            s = r["ratio_vs_best_peer"]
            print(
                f"  ours vs the best peer of each repeat: {s['median']:.2f}x (min {s['min']:.2f}, max {s['max']:.2f})"
            )
    for name, why in report["skipped"].items():
        print(f"skipped {name}: {why}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="128MiB")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=32, help="StreamingDataset's batch_size (per rank)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--targets", default="local,s3", help="comma-separated: local, s3")
    ap.add_argument("--dir", default=None, help="scratch parent directory (default: the system's temp)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.targets = set(args.targets.split(","))
    report = run(args)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
