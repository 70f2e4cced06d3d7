"""Throughput and memory of the tools: verify against the raw disk read, reshard and convert.

One run builds a synthetic model-plus-optimizer checkpoint (default 2 GiB: tensors of 1 to 64
MiB plus many small ones, fixed seed) with ``CheckpointWriter``, then measures, each with a
cold page cache (``sync; echo 3 > /proc/sys/vm/drop_caches``, when this process may write it):

- ``raw-read``: the checkpoint's data files read sequentially into one reused 64 MiB buffer, one
  thread (the disk's limit for a reader that touches every byte once); ``raw-read-par8``: the
  same bytes with 8 threads of 16 MiB ``preadv`` (what a parallel reader can get);
- ``verify``: :func:`verify_checkpoint` (every chunk's blake3), and ``verify --quick``. Each
  verify run follows a raw read, both cold; the median of the per-pair ratios is reported too
  (on a shared machine the load drifts between runs, and pairs see about the same);
- ``raw-copy``: the data files read sequentially and written to new files with fsync, one
  thread: the floor for a tool that reads and writes every byte once (reshard, convert);
- ``reshard``: to 2 ranks;
- ``convert``: to safetensors, torch and dcp, and from each back to goodput.

GB/s = bytes of the checkpoint's data files (raw, verify) or tensor bytes (reshard, convert)
divided by wall seconds, GB = 1e9 bytes. Each tool runs in a fresh process that reports its
wall time (imports excluded) and its peak resident memory above what it held after imports (sampled
from ``/proc/self/statm`` every 5 ms). Writes are durable (every writer fsyncs). Each figure is the median over
``--repeats``.

Run: ``.venv/bin/python benchmarks/bench_tools.py --size 2GiB --json bench-tools.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

warnings.filterwarnings("ignore")

GB = 1e9
MiB = 1 << 20


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def make_checkpoint(path: Path, size: int) -> int:
    """A model + Adam-like state of about ``size`` bytes; returns the tensor bytes."""
    import torch
    import torch.distributed.checkpoint as dcp

    from goodput_ckpt import CheckpointWriter

    g = torch.Generator().manual_seed(0)
    model, optim, total, i = {}, {}, 0, 0
    sizes_mib = [64, 32, 16, 8, 4, 2, 1]
    while total < size * 0.98:
        mib = sizes_mib[i % len(sizes_mib)]
        n = mib * MiB // 4 // 3  # param + exp_avg + exp_avg_sq
        w = torch.randn(n // 256, 256, generator=g)
        model[f"layer{i}.weight"] = w
        optim[f"layer{i}.weight"] = {
            "exp_avg": torch.randn(w.shape, generator=g),
            "exp_avg_sq": torch.rand(w.shape, generator=g),
            "step": torch.tensor(10.0),
        }
        total += 3 * w.numel() * 4
        i += 1
    for j in range(500):  # many small tensors: norms, biases
        model[f"norm{j}.weight"] = torch.randn(1024, generator=g)
        total += 4096
    sd = {"model": model, "optimizer": {"state": optim, "param_groups": [{"lr": 1e-3}]}, "step": 100}
    dcp.save(sd, storage_writer=CheckpointWriter(str(path)))
    return total


def raw_read(path: Path, threads: int) -> float:
    files = [p for p in path.iterdir() if p.suffix == ".bin"]
    t0 = time.perf_counter()
    if threads == 1:
        buf = bytearray(64 * MiB)
        view = memoryview(buf)
        for p in files:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(view):
                    pass
    else:

        def read(args):
            p, off, n = args
            fd = os.open(p, os.O_RDONLY)
            try:
                os.preadv(fd, [bytearray(n)], off)
            finally:
                os.close(fd)

        tasks = [
            (p, off, min(16 * MiB, p.stat().st_size - off))
            for p in files
            for off in range(0, p.stat().st_size, 16 * MiB)
        ]
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, tasks))
    return time.perf_counter() - t0


def raw_copy(src: Path, dst: Path) -> None:
    """Every data file read sequentially and written to ``dst`` with fsync: the floor of any
    tool that reads and writes every byte once."""
    buf = bytearray(64 * MiB)
    view = memoryview(buf)
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.iterdir()):
        if p.suffix != ".bin":
            continue
        fd = os.open(dst / p.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with open(p, "rb", buffering=0) as f:
                while n := f.readinto(view):
                    out = view[:n]
                    while out:
                        out = out[os.write(fd, out) :]
            os.fsync(fd)
        finally:
            os.close(fd)


# -- child mode: one tool in a fresh process --------------------------------------------------
class _RssSampler:
    """Peak resident memory of this process while a tool runs, sampled every 5 ms from
    /proc/self/statm (``ru_maxrss`` would also count the import peak)."""

    def __init__(self) -> None:
        import threading

        self._page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        return self.peak - self.start


def child(op: str, args: list[str]) -> None:
    from goodput_ckpt.tools.ops.convert import convert_checkpoint
    from goodput_ckpt.tools.ops.reshard import reshard_checkpoint
    from goodput_ckpt.tools.ops.verify import verify_checkpoint

    sampler = _RssSampler()
    base = sampler.start
    t0 = time.perf_counter()
    if op == "raw-read":
        raw_read(Path(args[0]), int(args[1]))
    elif op == "raw-copy":
        raw_copy(Path(args[0]), Path(args[1]))
    elif op == "verify":
        r = verify_checkpoint(args[0], quick=False, thread_count=int(args[1]) if len(args) > 1 else None)
        assert r.ok, r.problems
    elif op == "verify-quick":
        assert verify_checkpoint(args[0], quick=True).ok
    elif op == "reshard":
        reshard_checkpoint(args[0], args[1], world_size=int(args[2]))
    elif op == "convert":
        convert_checkpoint(args[0], args[1], to=args[2])
    else:
        raise SystemExit(f"unknown op {op}")
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "peak_above_imports": sampler.stop(), "imports_rss": base}))


def run_child(op: str, *args: str) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", op, *args], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{op} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one on /tmp's disk)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--threads", default="8", help="verify thread counts to measure, comma separated (first is the headline)"
    )
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.rest)
        return
    from goodput_ckpt.cli._output import parse_size

    scratch = Path(tempfile.mkdtemp(prefix="bench-tools-", dir=a.dir))
    try:
        src = scratch / "src"
        tensor_bytes = make_checkpoint(src, parse_size(a.size))
        file_bytes = sum(p.stat().st_size for p in src.iterdir())
        cold = drop_caches()
        results: dict[str, dict] = {}

        def record(name: str, nbytes: int, seconds: list[float], peaks: list[int] | None = None) -> None:
            s = statistics.median(seconds)
            results[name] = {
                "seconds": s,
                "gbps": nbytes / s / GB,
                "runs_gbps": [round(nbytes / x / GB, 3) for x in seconds],
                "peak_mib": (statistics.median(peaks) / MiB) if peaks else None,
            }

        ratios: dict[int, list[float]] = {}
        for _rep in range(a.repeats):
            drop_caches()
            results.setdefault("_raw8", {"runs": []})["runs"].append(run_child("raw-read", str(src), "8")["seconds"])
            for t in [int(x) for x in a.threads.split(",")]:
                # Raw read and verify back to back, each cold, so that both see the same load on
                # this shared machine; the ratio of each pair is what is reported.
                drop_caches()
                raw = run_child("raw-read", str(src), "1")["seconds"]
                results.setdefault("_raw1", {"runs": []})["runs"].append(raw)
                drop_caches()
                results.setdefault(f"_verify{t}", {"runs": [], "peaks": []})
                r = run_child("verify", str(src), str(t))
                results[f"_verify{t}"]["runs"].append(r["seconds"])
                results[f"_verify{t}"]["peaks"].append(r["peak_above_imports"])
                ratios.setdefault(t, []).append(raw / r["seconds"])
            drop_caches()
            r = run_child("verify-quick", str(src))
            results.setdefault("_quick", {"runs": [], "peaks": []})["runs"].append(r["seconds"])
            jobs = [
                ("raw-copy", "raw-copy", str(src), str(scratch / "copy")),
                ("reshard-to-2", "reshard", str(src), str(scratch / "w2"), "2"),
            ]
            for fmt, dst in (("safetensors", "m.safetensors"), ("torch", "m.pt"), ("dcp", "d")):
                jobs.append((f"convert-to-{fmt}", "convert", str(src), str(scratch / dst), fmt))
                jobs.append(
                    (
                        f"convert-{fmt}-to-goodput",
                        "convert",
                        str(scratch / dst),
                        str(scratch / f"back-{fmt}"),
                        "goodput",
                    )
                )
            for name, op, *args in jobs:
                drop_caches()
                r = run_child(op, *args)
                slot = results.setdefault(f"_{name}", {"runs": [], "peaks": []})
                slot["runs"].append(r["seconds"])
                slot["peaks"].append(r["peak_above_imports"])
                if name.endswith("to-goodput") or name.startswith(("reshard", "raw-copy")):
                    shutil.rmtree(args[1], ignore_errors=True)
            for p in (scratch / "m.safetensors", scratch / "m.objects.json", scratch / "m.pt"):
                p.unlink(missing_ok=True)
            shutil.rmtree(scratch / "d", ignore_errors=True)

        record("raw-read", file_bytes, results.pop("_raw1")["runs"])
        record("raw-read-par8", file_bytes, results.pop("_raw8")["runs"])
        for t in [int(x) for x in a.threads.split(",")]:
            v = results.pop(f"_verify{t}")
            record(f"verify-t{t}", file_bytes, v["runs"], v["peaks"])
        q = results.pop("_quick")
        record("verify-quick", file_bytes, q["runs"])
        for key in [k for k in results if k.startswith("_")]:
            v = results.pop(key)
            record(key[1:], tensor_bytes, v["runs"], v["peaks"])
        for t, rs in ratios.items():
            results[f"verify-t{t}"]["x_raw_paired"] = statistics.median(rs)
        raw = results["raw-read"]["gbps"]
        print(
            f"checkpoint: {file_bytes / GB:.2f} GB in data files, {tensor_bytes / GB:.2f} GB of tensors; cold cache: {cold}; "
            f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )
        for t, rs in ratios.items():
            print(
                f"verify-t{t} / raw-read, paired runs: median {statistics.median(rs):.2f} ({', '.join(f'{x:.2f}' for x in rs)})"
            )
        copy = results["raw-copy"]["gbps"]
        print(f"{'method':32s} {'GB/s':>7s} {'x raw-read':>10s} {'x raw-copy':>10s} {'peak MiB':>9s}")
        for name, r in results.items():
            peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
            print(f"{name:32s} {r['gbps']:7.2f} {r['gbps'] / raw:10.2f} {r['gbps'] / copy:10.2f} {peak:>9s}")
        if a.json:
            Path(a.json).write_text(
                json.dumps(
                    {
                        "size": file_bytes,
                        "tensor_bytes": tensor_bytes,
                        "cold_cache": cold,
                        "cpus": os.cpu_count(),
                        "results": results,
                    },
                    indent=2,
                )
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
