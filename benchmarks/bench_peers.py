"""Checkpoint save and load against the libraries a user would pick instead (issue 38).

One process, one synthetic model-plus-optimizer state (``goodput_ckpt.tools.measure._bench_state``, fixed
seed), every method in the same run, the order of the methods rotating per repeat:

- **local** (a scratch directory): ``ours`` (``CheckpointWriter`` / ``CheckpointReader(verify=True)``
  through ``dcp.save``/``dcp.load``) vs ``torch-fs`` (torch's ``FileSystemWriter`` /
  ``FileSystemReader`` at their defaults, ``sync_files=True``);
- **s3** (SeaweedFS on 127.0.0.1, after an untimed warm-up write of 4 x 32 MiB objects: SeaweedFS
  grows volumes on first writes): ``ours`` vs ``s3tc`` (s3torchconnector's DCP
  ``S3StorageWriter``/``S3StorageReader`` at their defaults) and ``s3tc-t8`` (``thread_count=8``),
  and ``fsspec`` (torch's ``FsspecWriter`` over s3fs) when s3fs imports;
- **tiers** (checkpoints of a ``Linear`` stack plus AdamW, ``benchmarks/bench_stall.py``'s model, on
  local disk, through each library's checkpoint manager; a one-rank gloo group, which nvrx and
  torchtitan need): ``manager`` (our ``CheckpointManager`` on one local root, ``async_staging=False``:
  ``save`` returns once the state is copied into reused buffers; ``restore`` verifies every chunk),
  ``manager-sync`` (``async_save=False``: ``save`` returns once the checkpoint is committed; compared
  with the peers whose save also blocks, ``ratios_sync``) and ``manager-2tier`` (the same with ``local_dir`` and a second local directory as the persistent
  tier: ``durable`` then includes the copy to the persistent tier) vs ``nvrx-local``
  (nvidia-resiliency-ext's ``LocalCheckpointManager``, with a CPU adapter of its
  ``BasicTensorAwareStateDict``, which asserts CUDA tensors; its ``save`` is ``torch.save`` + rename,
  no fsync, and its ``is_async=True`` calls ``torch.cuda.synchronize()``, so on CPU only the
  synchronous save runs), ``nvrx-local+fsync`` (the same followed by an fsync of its file, as durable
  as ours) and torchtitan's ``CheckpointManager`` with ``async_mode`` ``disabled`` (``titan-sync``)
  and ``async`` (``titan-async``: ``dcp.async_save`` with torch's ``FileSystemWriter``, which stages
  into fresh memory), given Stateful stand-ins for its optimizer and LR-scheduler containers
  (the same ``state_dict``/``load_state_dict`` calls). ``stall`` is the time ``save`` blocks the
  loop (plus ``maybe_wait_for_staging`` for torchtitan); ``durable`` the time until the checkpoint
  is on disk; ``restore`` a new manager's load into the scrambled model and optimizer, with its
  CPU seconds (every thread of this process). Each manager's first save is untimed (buffers,
  groups). ``--restore-cache`` sets what of each method's files is in the page cache when its
  restore starts: ``as-left`` (default) as its own save left it (our async manager writes its data
  files around the page cache, so its restore reads the device; nvrx's and torchtitan's files stay
  cached), ``warm`` every file read once first, ``cold`` every file fsynced and dropped first.

Each timed save follows an untimed warm-up save of the same method into a sibling location,
removed first (``goodput_ckpt.tools.measure._bench_save.timed_save``). Every load is checked bit-exact
against the state. A peer that cannot run here is printed as ``skipped`` with the reason. One
process is one rank, so the worst rank is that rank (multi-rank runs: ``bench_tiers.py``,
``bench_requests.py``). Figures: min/median/max over ``--repeats``; each ratio is ours / theirs in
throughput (theirs' seconds / ours' seconds) within one repeat, so the ratios share the
machine's conditions of that moment.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_peers.py --size 256MiB --repeats 3 --json peers.json``
(peers: ``pip install -e '.[bench]'``; SeaweedFS: the ``test`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the SeaweedFS recipe
sys.path.insert(0, str(Path(__file__).resolve().parent))

from goodput_ckpt import CheckpointReader, CheckpointWriter  # noqa: E402
from goodput_ckpt.cli._output import parse_size  # noqa: E402
from goodput_ckpt.tools.measure._bench_measure import spread_of as stats  # noqa: E402
from goodput_ckpt.tools.measure._bench_save import timed_save  # noqa: E402
from goodput_ckpt.tools.measure._bench_state import make_state  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", category=FutureWarning)

MiB = 1 << 20
Method = tuple[Callable[[str], Any], Callable[[str], Any]]  # save(where), load(where) -> state read


def zeros_like(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    return {k: zeros_like(v) for k, v in obj.items()}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def rotate(names: list[str], r: int) -> list[str]:
    k = r % len(names)
    return names[k:] + names[:k]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def wall_and_cpu(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """Wall seconds, this process's CPU seconds (every thread; servers are other processes), result."""
    c0, t0 = _cpu(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, _cpu() - c0, out


def run_rounds(
    methods: dict[str, Method],
    state: Any,
    repeats: int,
    remove: Callable[[str], None],
    where: Callable[[str, str], str],
) -> dict[str, Any]:
    """Save (after a warm-up save) and load with every method once per repeat, rotating the order."""
    secs: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in methods}
    cpu: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in methods}
    order = []
    for r in range(repeats):
        rotated = rotate(list(methods), r)
        order.append(rotated)
        for m in rotated:
            save, load = methods[m]
            target = where(m, f"r{r}")
            wall, c, _ = timed_save(save, target, warm=where(m, f"r{r}-warm"), remove=remove, clock=wall_and_cpu)
            secs[m]["save"].append(wall)
            cpu[m]["save"].append(c)
            wall, c, got = wall_and_cpu(lambda: load(target))  # noqa: B023 - called at once
            secs[m]["load"].append(wall)
            cpu[m]["load"].append(c)
            if not same(state, got):
                raise AssertionError(f"{m}: the loaded state differs from the saved one")
            remove(target)
    return {"order": order, "seconds": secs, "cpu_seconds": cpu}


def ratios(res: dict[str, Any], ours: str = "ours") -> dict[str, Any]:
    """Per peer and phase: theirs' seconds / ours' seconds in the same repeat (> 1: ours is faster)."""
    secs = res["seconds"]
    return {
        peer: {p: stats([t / o for t, o in zip(secs[peer][p], secs[ours][p])]) for p in ("save", "load")}
        for peer in secs
        if peer != ours
    }


# -- local DCP --------------------------------------------------------------------------------------
def local_methods(state: Any) -> dict[str, Method]:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    def ours_load(d: str) -> Any:
        dest = zeros_like(state)
        dcp.load(dest, storage_reader=CheckpointReader(d, verify=True))
        return dest

    def fs_load(d: str) -> Any:
        dest = zeros_like(state)
        dcp.load(dest, storage_reader=FileSystemReader(d))
        return dest

    return {
        "ours": (lambda d: dcp.save(state, storage_writer=CheckpointWriter(d)), ours_load),
        "torch-fs": (lambda d: dcp.save(state, storage_writer=FileSystemWriter(d)), fs_load),
    }


# -- S3 ---------------------------------------------------------------------------------------------
def s3_methods(state: Any, url: str, bucket: str, skipped: dict[str, str]) -> dict[str, Method]:
    opts = {"endpoint_url": url, "addressing_style": "path", "region": "us-east-1"}

    def ours_load(p: str) -> Any:
        dest = zeros_like(state)
        dcp.load(dest, storage_reader=CheckpointReader(f"s3://{bucket}/{p}", verify=True, **opts))
        return dest

    out: dict[str, Method] = {
        "ours": (lambda p: dcp.save(state, storage_writer=CheckpointWriter(f"s3://{bucket}/{p}", **opts)), ours_load)
    }
    try:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    except ImportError as e:
        skipped["s3tc"] = f"s3torchconnector does not import ({e}): pip install 's3torchconnector[dcp]'"
    else:
        cfg = S3ClientConfig(force_path_style=True)

        def client() -> Any:  # its DCP classes take no endpoint: the TESTING.md recipe
            return S3Client("us-east-1", endpoint=url, s3client_config=cfg)

        def s3tc(threads: int | None) -> Method:
            def save(p: str) -> None:
                kw = {} if threads is None else {"thread_count": threads}
                w = S3StorageWriter("us-east-1", f"s3://{bucket}/{p}", s3client_config=cfg, **kw)
                w.fs._client = client()
                dcp.save(state, storage_writer=w)

            def load(p: str) -> Any:
                rd = S3StorageReader("us-east-1", f"s3://{bucket}/{p}", s3client_config=cfg)
                rd.fs._client = client()
                dest = zeros_like(state)
                dcp.load(dest, storage_reader=rd)
                return dest

            return save, load

        out["s3tc"], out["s3tc-t8"] = s3tc(None), s3tc(8)
    try:
        import s3fs  # noqa: F401
    except ImportError:
        skipped["fsspec"] = (
            "s3fs is not installed (pip install s3fs; on the development machine its releases for "
            "this fsspec require a botocore older than the project's boto3)"
        )
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        so = {"endpoint_url": url, "client_kwargs": {"region_name": "us-east-1"}}

        def fs_load(p: str) -> Any:
            dest = zeros_like(state)
            dcp.load(dest, storage_reader=FsspecReader(f"s3://{bucket}/{p}", **so))
            return dest

        out["fsspec"] = (lambda p: dcp.save(state, storage_writer=FsspecWriter(f"s3://{bucket}/{p}", **so)), fs_load)
    return out


def s3_remover(client: Any, bucket: str) -> Callable[[str], None]:
    def remove(prefix: str) -> None:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys})

    return remove


# -- the run ----------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    st = make_state(parse_size(args.size))
    report: dict[str, Any] = {
        "bytes": st.nbytes,
        "tensors": len(st.flat),
        "repeats": args.repeats,
        "world_size": 1,
        "load_average_before": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "skipped": {},
    }
    skipped = report["skipped"]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        if "local" in args.targets:
            root = Path(tmp, "local")
            root.mkdir()
            res = run_rounds(
                local_methods(st.nested),
                st.nested,
                args.repeats,
                lambda d: shutil.rmtree(d, ignore_errors=True),
                lambda m, tag: str(root / f"{m}-{tag}"),
            )
            report["local"] = {**res, "ratios": ratios(res)}
        if "s3" in args.targets:
            import boto3
            from helpers.s3 import SeaweedServer, s3_env

            os.environ.update(s3_env())
            server = SeaweedServer(Path(tmp, "weed"))
            try:
                client = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1")
                client.create_bucket(Bucket="peers")
                for i in range(4):  # untimed warm-up: SeaweedFS grows its volumes on the first writes
                    client.put_object(Bucket="peers", Key=f"warm/{i}", Body=os.urandom(32 * MiB))
                s3_remover(client, "peers")("warm")
                res = run_rounds(
                    s3_methods(st.nested, server.url, "peers", skipped),
                    st.nested,
                    args.repeats,
                    s3_remover(client, "peers"),
                    lambda m, tag: f"{m}-{tag}",
                )
                report["s3"] = {**res, "ratios": ratios(res)}
            finally:
                server.stop()
        if "tiers" in args.targets:
            from peers_tiers import run_tiers

            report["tiers"] = run_tiers(parse_size(args.size), args.repeats, Path(tmp), skipped, args.restore_cache)
    report["load_average_after"] = os.getloadavg()[0]
    return report


def fmt(s: dict[str, Any]) -> str:
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def print_report(report: dict[str, Any]) -> None:
    print(
        f"state: {report['bytes'] / MiB:.0f} MiB in {report['tensors']} tensors; {report['repeats']} repeats; 1 rank; "
        f"load average {report['load_average_before']:.2f} before, {report['load_average_after']:.2f} after, "
        f"on {report['cpus']} CPUs"
    )
    for target in ("local", "s3"):
        if target not in report:
            continue
        r = report[target]
        print(f"{target}: order " + " | ".join(", ".join(o) for o in r["order"]))
        for m, s in r["seconds"].items():
            mib = report["bytes"] / MiB
            c = r["cpu_seconds"][m]
            print(
                f"  {m:9s} save {mib / statistics.median(s['save']):6.0f} MiB/s, {statistics.median(c['save']):.2f} CPU-s  "
                f"load {mib / statistics.median(s['load']):6.0f} MiB/s, {statistics.median(c['load']):.2f} CPU-s (medians)"
            )
        for peer, rr in r["ratios"].items():
            print(
                f"  ours vs {peer:9s} save {fmt(rr['save'])}  load {fmt(rr['load'])}  (median (min-max) of theirs/ours seconds)"
            )
    if "tiers" in report:
        r = report["tiers"]
        print(
            f"tiers ({r['bytes'] / MiB:.0f} MiB Linear stack + AdamW; restores from a page cache "
            f"{r['restore_cache']}): order " + " | ".join(", ".join(o) for o in r["order"])
        )
        for m, s in r["seconds"].items():
            print(
                f"  {m:16s} stall {statistics.median(s['stall']):.3f} s  durable {statistics.median(s['durable']):.3f} s  "
                f"restore {statistics.median(s['restore']):.3f} s, {statistics.median(s['restore_cpu']):.3f} CPU-s (medians)"
            )
        for ours, key in (("manager", "ratios"), ("manager-sync", "ratios_sync")):
            for peer, rr in r[key].items():
                print(
                    f"  {ours} vs {peer:16s} stall {fmt(rr['stall'])}  durable {fmt(rr['durable'])}  "
                    f"restore {fmt(rr['restore'])}"
                )
    for name, why in report["skipped"].items():
        print(f"skipped {name}: {why}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="256MiB", help="state size (default 256MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--targets", default="local,s3,tiers", help="comma-separated: local, s3, tiers")
    ap.add_argument("--dir", default=None, help="scratch parent directory (default: the system's temp)")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument(
        "--restore-cache",
        default="as-left",
        choices=("as-left", "warm", "cold"),
        help="tiers: the page cache state each restore starts from (default as-left: as its own save left it)",
    )
    args = ap.parse_args(argv)
    args.targets = set(args.targets.split(","))
    report = run(args)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
