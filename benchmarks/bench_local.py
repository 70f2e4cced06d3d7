"""Local-disk save and load throughput: goodput-ckpt against torch and the raw disk.

One run measures, on the same synthetic model-plus-optimizer state (fixed seed), the save and
cold-cache load throughput of:

- ``ours``: ``CheckpointWriter`` / ``CheckpointReader(verify=True)`` through ``dcp.save``/``dcp.load``;
- ``ours-nohash``: the same save with blake3 replaced by a no-op hasher *inside this benchmark
  only* (the ``blake3`` name of every goodput_ckpt module that imported it is patched for the
  duration of the save; the library has no switch). Load without hashing is ``ours-noverify``:
  the ``ours`` checkpoint loaded with ``CheckpointReader(verify=False)``;
- ``fsw-default`` / ``fsw-t4``: torch's ``FileSystemWriter`` at its defaults and with
  ``thread_count=4``, each loaded with ``FileSystemReader`` (which has no thread option);
- ``torch.save`` / ``torch.load(weights_only=True)`` of the nested dict, in one file;
- ``safetensors``: ``save_file`` / ``load_file`` of the flattened dict (it takes only tensors).
  ``load_file`` returns tensors over a lazy mmap of the file, so the timed load also reads one
  byte of every 4 KiB page (otherwise it would time only the header parse);
- ``raw``: the same bytes written sequentially to one file and fsynced, then read back
  sequentially into one preallocated buffer (the disk's limit); ``raw-par4`` reads the same file
  with 4 threads, for reference.

Rules, the same for every method:
- GB/s = payload bytes (the sum of tensor sizes, identical for all methods) / wall seconds,
  with GB = 1e9 bytes, so every ratio is a ratio of times.
- Every timed save comes right after an untimed warm-up save of the same method into a sibling
  directory, deleted just before the clock starts: ``goodput_ckpt/tools/measure/_bench_save.py``, the
  rule ``goodput-ckpt bench`` shares. Without it a save's time depended on how long memory had
  sat free before it (see Noise below), and the two tools disagreed (issue 21).
- Saves include durability: every data file is fsynced before the clock stops. FileSystemWriter
  (sync_files=True by default) and CheckpointWriter fsync themselves; for torch.save and
  safetensors the benchmark fsyncs the file. The benchmark fsyncs the directory after every save.
- The measurement procedure is ``goodput_ckpt/tools/measure/_bench_measure.py``, the one
  ``goodput-ckpt bench`` runs: rotating order, quiet wait, warm-up, eviction, per-repeat ratios.
- Loads start with a cold page cache: the checkpoint's files are evicted before each load
  (``posix_fadvise(DONTNEED)``, no root, nothing else's cache; a whole-machine ``drop_caches``
  also freed memory that the next steps then faulted back in). DCP loads go into a preallocated, already-touched destination dict (as when resuming into a live model);
  torch.load, safetensors and the raw read allocate what they return, as they always do.
- Methods run round-robin within each repeat, the start rotating per repeat, and files are
  deleted after each method. Each figure is the median over ``--repeats``; the fastest repeat
  ("best") is shown beside it, and the targets of issue 2 are printed for both.

Noise: the machine is shared. Before each measurement the benchmark waits (up to ``--quiet``
seconds) until other processes leave the CPUs and the disk idle, and it records how many CPUs
others used during the measurement ("others"). On this VM a second effect, invisible to that
gauge, dominates: memory that sat free for a few seconds is handed back to the host (virtio
balloon free-page reporting), and touching it again (the page cache of a save, a load's
allocations) can cost 1-2 s of CPU per GiB instead of 0.25 s. It slows random repeats of every
method by 2-4x; the warm-up save before every timed save keeps the timed save's memory from
being handed back (a save after 8 s of idle memory took 3-5x longer: docs/benchmarks.md), and
the best repeat approximates the cost without it.

Run: ``.venv/bin/python benchmarks/bench_local.py --size 2GiB --repeats 2 --json bench.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

# The synthetic state is the library's, so `goodput-ckpt bench` measures the same one.
from goodput_ckpt.cli._output import parse_size
from goodput_ckpt.tools.measure._bench_measure import (  # noqa: F401 - wait_quiet, _busy_seconds: sweep_local, bench_tiers
    DEFAULT_QUIET,
    Load,
    Sample,
    _busy_seconds,
    ratio_spread,
    run_rotation,
    save_and_load,
    wait_quiet,
)
from goodput_ckpt.tools.measure._bench_measure import measure as timed  # noqa: F401 - sweep_local's name for it
from goodput_ckpt.tools.measure._bench_scratch import evict_page_cache
from goodput_ckpt.tools.measure._bench_state import State, empty_like_nested, flat_equal, flatten, make_state

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", category=FutureWarning)

GB = 1e9
MiB = 1 << 20
ALL_METHODS = ("raw", "ours", "ours-nohash", "fsw-default", "fsw-t4", "torch.save", "safetensors")


# -- the environment ------------------------------------------------------------------------------
def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False when not permitted (bench_volume, sweep_local;
    this script's loads evict only the checkpoint's files, as ``goodput-ckpt bench`` does)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file under ``root`` (for methods that do not fsync themselves)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fsync_path(os.path.join(dirpath, name))


def tree_files(root: str) -> tuple[int, int]:
    n = size = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            n += 1
            size += os.path.getsize(os.path.join(dirpath, name))
    return n, size


def raw_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# -- methods --------------------------------------------------------------------------------------
class _NoHash:
    """Stands in for ``blake3.blake3`` to measure a save without hashing."""

    def __init__(self, *_a: Any, **_k: Any) -> None:
        pass

    def update(self, _data: Any) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 64


@contextlib.contextmanager
def no_save_hashing() -> Iterator[None]:
    """Replace ``blake3`` by a no-op hasher in every goodput_ckpt module that imported it.

    Only the write path hashes during a save, so this turns off exactly the save's hashing
    (wherever the code that hashes lives), and nothing else. The manifest then holds dummy
    digests: the checkpoint is not loaded with verification afterwards.
    """
    import types

    import blake3

    import goodput_ckpt.dcp.writer  # noqa: F401 - loads the write path's modules

    fake = types.SimpleNamespace(blake3=_NoHash)
    patched = [
        m
        for n, m in list(sys.modules.items())
        if n.startswith("goodput_ckpt.") and getattr(m, "blake3", None) is blake3
    ]
    if not patched:
        raise RuntimeError("no goodput_ckpt module imports blake3: update no_save_hashing")
    for m in patched:
        m.blake3 = fake
    try:
        yield
    finally:
        for m in patched:
            m.blake3 = blake3


@dataclass
class Ctx:
    state: State
    dest: dict[str, Any]  # DCP load destination, same structure as state.nested
    raw_buf: torch.Tensor  # raw-read destination (uint8, nbytes)
    writer_kw: dict[str, Any] = field(default_factory=dict)
    reader_kw: dict[str, Any] = field(default_factory=dict)
    dev: int | None = None  # st_dev of the benchmark directory, for wait_quiet's disk check


def _raw_save(ctx: Ctx, d: str) -> None:
    fd = os.open(os.path.join(d, "raw.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in ctx.state.flat.values():
            view = raw_bytes(t)
            while view:
                view = view[os.write(fd, view[: 64 * MiB]) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_read(ctx: Ctx, d: str, threads: int = 1, block: int = 16 * MiB) -> dict | None:
    buf = raw_bytes(ctx.raw_buf)
    fd = os.open(os.path.join(d, "raw.bin"), os.O_RDONLY)
    try:
        if threads == 1:
            off = 0
            while off < len(buf):
                n = os.preadv(fd, [buf[off : off + block]], off)
                if n == 0:
                    raise EOFError("raw.bin is short")
                off += n
        else:
            from concurrent.futures import ThreadPoolExecutor

            def part(off: int) -> None:
                end = min(len(buf), off + block)
                while off < end:
                    n = os.preadv(fd, [buf[off:end]], off)
                    if n == 0:
                        raise EOFError("raw.bin is short")
                    off += n

            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(part, range(0, len(buf), block)))
    finally:
        os.close(fd)
    return None


def _raw_direct_read(ctx: Ctx, d: str, threads: int = 4, block: int = 16 * MiB) -> None:
    """The device's limit for direct reads: O_DIRECT into page-aligned buffers, no copy."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    size = ctx.raw_buf.numel()
    fd = os.open(os.path.join(d, "raw.bin"), os.O_RDONLY | os.O_DIRECT)
    bufs = [mmap.mmap(-1, block) for _ in range(threads)]

    def lane(i: int) -> None:
        view = memoryview(bufs[i])
        for off in range(i * block, size, threads * block):
            if os.preadv(fd, [view], off) == 0:
                raise EOFError("raw.bin is short")

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lane, range(threads)))
    finally:
        os.close(fd)
        for b in bufs:
            b.close()


def _ours_save(ctx: Ctx, d: str) -> None:
    from goodput_ckpt import CheckpointWriter

    dcp.save(ctx.state.nested, storage_writer=CheckpointWriter(d, **ctx.writer_kw))


def _ours_nohash_save(ctx: Ctx, d: str) -> None:
    with no_save_hashing():
        _ours_save(ctx, d)


def _ours_load(verify: bool, **options: Any) -> Callable[[Ctx, str], dict]:
    def load(ctx: Ctx, d: str) -> dict:
        from goodput_ckpt import CheckpointReader

        kw = {**ctx.reader_kw, **options}
        dcp.load(ctx.dest, storage_reader=CheckpointReader(d, verify=verify, **kw))
        return ctx.dest

    return load


def _fsw_save(**kw: Any) -> Callable[[Ctx, str], None]:
    def save(ctx: Ctx, d: str) -> None:
        dcp.save(ctx.state.nested, storage_writer=dcp.FileSystemWriter(d, **kw))

    return save


def _fsr_load(ctx: Ctx, d: str) -> dict:
    dcp.load(ctx.dest, storage_reader=dcp.FileSystemReader(d))
    return ctx.dest


def _torch_save(ctx: Ctx, d: str) -> None:
    with open(os.path.join(d, "state.pt"), "wb") as f:
        torch.save(ctx.state.nested, f)
        f.flush()
        os.fsync(f.fileno())  # torch.save does not fsync


def _torch_load(ctx: Ctx, d: str) -> dict:
    return torch.load(os.path.join(d, "state.pt"), weights_only=True, map_location="cpu")


def _st_save(ctx: Ctx, d: str) -> None:
    from safetensors.torch import save_file

    path = os.path.join(d, "state.safetensors")
    save_file(ctx.state.flat, path)
    fsync_path(path)  # save_file does not fsync


def _st_load(ctx: Ctx, d: str) -> dict:
    from safetensors.torch import load_file

    out = load_file(os.path.join(d, "state.safetensors"))
    for t in out.values():  # load_file maps the file lazily: fault in every page, as a use would
        t.reshape(-1).view(torch.uint8)[::4096].sum()
    return out


@dataclass(frozen=True)
class Method:
    name: str
    save: Callable[[Ctx, str], None]
    loads: tuple[tuple[str, Callable[[Ctx, str], Any]], ...]
    save_note: str


METHODS: dict[str, Method] = {
    "raw": Method(
        "raw",
        _raw_save,
        (("raw", _raw_read), ("raw-par4", lambda c, d: _raw_read(c, d, 4)), ("raw-direct4", _raw_direct_read)),
        "1 thread, os.write <=64 MiB, fsync; read 1 thread / 4 threads, 16 MiB preadv / "
        "4 threads, 16 MiB O_DIRECT preadv into reused aligned buffers (no copy)",
    ),
    "ours": Method(
        "ours",
        _ours_save,
        (
            ("ours", _ours_load(True)),
            ("ours-noverify", _ours_load(False)),
            ("ours-direct", _ours_load(True, direct_reads=True)),
        ),
        "CheckpointWriter (fsyncs itself); load verify=True / verify=False / "
        "verify=True with O_DIRECT reads (direct_reads=True)",
    ),
    "ours-nohash": Method("ours-nohash", _ours_nohash_save, (), "CheckpointWriter with blake3 patched to a no-op"),
    "fsw-default": Method(
        "fsw-default",
        _fsw_save(),
        (("fsw-default", _fsr_load),),
        "FileSystemWriter() (sync_files=True fsyncs); FileSystemReader()",
    ),
    "fsw-t4": Method(
        "fsw-t4",
        _fsw_save(thread_count=4),
        (("fsw-t4", _fsr_load),),
        "FileSystemWriter(thread_count=4); FileSystemReader()",
    ),
    "torch.save": Method(
        "torch.save",
        _torch_save,
        (("torch.save", _torch_load),),
        "torch.save + explicit fsync; torch.load(weights_only=True)",
    ),
    "safetensors": Method(
        "safetensors",
        _st_save,
        (("safetensors", _st_load),),
        "save_file + explicit fsync; load_file (mmap) + touch every page",
    ),
}


# -- the runner: the shared procedure (goodput_ckpt/tools/measure/_bench_measure.py) -----------------------
def run_method(
    m: Method,
    ctx: Ctx,
    base: str,
    samples: dict[str, list[Sample]],
    check: bool,
    reverse_loads: bool = False,
    quiet: float = DEFAULT_QUIET,
) -> dict[str, Any]:
    """One method, one repeat, by the procedure ``goodput-ckpt bench`` runs (save_and_load)."""
    d = tempfile.mkdtemp(prefix=m.name.replace(".", "_") + "-", dir=base)
    info: dict[str, Any] = {}

    def save(where: str) -> None:
        os.makedirs(where, exist_ok=True)
        m.save(ctx, where)
        fsync_path(where)

    def after(name: str) -> Callable[[Any], None]:
        def check_and_reset(out: Any) -> None:
            if check and out is not None and not flat_equal(ctx.state.flat, flatten(out)):
                raise SystemExit(f"{name}: loaded values differ from the saved state")
            if out is ctx.dest:
                for t in flatten(ctx.dest).values():
                    t.zero_()  # the next load must really write every byte

        return check_and_reset

    def files(where: str) -> None:
        info["files"], info["disk_bytes"] = tree_files(where)

    loads = [Load(name, lambda where, load=load: load(ctx, where), after(name)) for name, load in m.loads]
    got = save_and_load(
        save,
        loads[::-1] if reverse_loads else loads,
        target=d,
        warm=d + "-warm",
        remove=lambda p: shutil.rmtree(p, ignore_errors=True),
        evict=evict_page_cache,
        quiet=quiet,
        dev=ctx.dev,
        between=files,
    )
    samples.setdefault(f"save:{m.name}", []).append(got.save)
    for name, sample in got.loads.items():
        samples.setdefault(f"load:{name}", []).append(sample)
    info["cold"] = all(got.cold) if got.cold else None
    return info


def run(
    state: State,
    methods: list[str],
    repeats: int,
    base: str,
    writer_kw: dict | None = None,
    reader_kw: dict | None = None,
    check: bool = True,
    quiet: float = DEFAULT_QUIET,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    ctx = Ctx(
        state,
        empty_like_nested(state.nested),
        torch.zeros(state.nbytes, dtype=torch.uint8),
        dict(writer_kw or {}),
        dict(reader_kw or {}),
        os.stat(base).st_dev,
    )
    samples: dict[str, list[Sample]] = {}
    infos: dict[str, Any] = {}
    load0 = os.getloadavg()

    def one(name: str, rep: int) -> None:
        t0 = time.perf_counter()
        infos[name] = run_method(
            METHODS[name], ctx, base, samples, check and rep == 0, reverse_loads=rep % 2 == 1, quiet=quiet
        )
        log(f"  repeat {rep + 1}/{repeats} {name:<12} {time.perf_counter() - t0:6.1f} s")

    order = run_rotation(methods, repeats, one)
    cold = all(i.get("cold") for i in infos.values() if i.get("cold") is not None)
    results = {}
    for key, ss in samples.items():
        wall = statistics.median(s.wall for s in ss)
        results[key] = {
            "seconds": [round(s.wall, 4) for s in ss],
            "cpu_seconds": [round(s.cpu, 4) for s in ss],
            "other_cpus": [round(s.other, 2) for s in ss],
            "median_s": wall,
            "best_gbps": state.nbytes / min(s.wall for s in ss) / GB,
            "worst_gbps": state.nbytes / max(s.wall for s in ss) / GB,
            "gbps": state.nbytes / wall / GB,
        }
    return {
        "results": results,
        "methods": infos,
        "cold_cache": cold,
        "order": order,
        "loadavg": {"start": load0, "end": os.getloadavg()},
    }


def ratios(res: dict[str, Any], stat: str = "gbps") -> dict[str, dict[str, Any]]:
    """The issue's targets, from medians (``stat="gbps"``) or best repeats (``"best_gbps"``)."""

    def g(key: str) -> float | None:
        r = res.get(key)
        return r[stat] if r else None

    def spread(a: str, b: str) -> str:
        """a's speed over b's per repeat, min / median / max (the shared ratio_spread)."""
        sp = ratio_spread(res[a]["seconds"], res[b]["seconds"])
        return "-" if sp is None else sp.text()

    def ratio(a: str, b: str, target: float, kind: str = "min") -> dict[str, Any] | None:
        x, y = g(a), g(b)
        if x is None or y is None:
            return None
        v = x / y
        return {
            "value": v,
            "target": target,
            "kind": kind,
            "ok": v >= target,
            "of": f"{a} / {b}",
            "per_repeat": spread(a, b),
        }

    def overhead(hashed: str, plain: str, limit: float) -> dict[str, Any] | None:
        x, y = g(hashed), g(plain)
        if x is None or y is None:
            return None
        v = 1 - x / y
        return {
            "value": v,
            "target": limit,
            "kind": "max",
            "ok": v <= limit,
            "of": f"1 - {hashed} / {plain} (throughput lost to hashing)",
            "per_repeat": spread(hashed, plain),
        }

    out = {
        "save vs raw write+fsync": ratio("save:ours", "save:raw", 0.9),
        "save vs FileSystemWriter default": ratio("save:ours", "save:fsw-default", 1.4),
        "cold load vs FileSystemReader default": ratio("load:ours", "load:fsw-default", 2.0),
        "cold load vs raw sequential read": ratio("load:ours", "load:raw", 0.9),
        "hashing overhead on save": overhead("save:ours", "save:ours-nohash", 0.10),
        "hashing overhead on load": overhead("load:ours", "load:ours-noverify", 0.10),
    }
    out = {k: v for k, v in out.items() if v is not None}
    # Context, not targets: how much faster than FileSystemReader any reader of this disk could
    # be, taking the parallel raw read as the disk's limit.
    for name, a, b in (
        ("(disk limit) raw-par4 vs FileSystemReader", "load:raw-par4", "load:fsw-default"),
        ("O_DIRECT reads vs default (both verified)", "load:ours-direct", "load:ours"),
        ("(disk limit) raw-direct4 vs raw-par4", "load:raw-direct4", "load:raw-par4"),
        ("(disk limit) raw-par4 vs raw sequential read", "load:raw-par4", "load:raw"),
    ):
        x, y = g(a), g(b)
        if x is not None and y is not None:
            out[name] = {
                "value": x / y,
                "target": None,
                "kind": "info",
                "ok": True,
                "of": f"{a} / {b}",
                "per_repeat": spread(a, b),
            }
    return out


def table(report: dict[str, Any]) -> str:
    """The results as text: one row per load variant, then the notes."""
    res = report["results"]
    head = (
        f"{'method':<15}{'save GB/s':>10}{'load GB/s':>10}{'save min-max':>13}{'load min-max':>13}{'save s':>8}"
        f"{'load s':>8}{'save cpu':>9}{'load cpu':>9}{'others':>10}{'files':>6}"
    )
    lines = [head]

    def fmt(r: dict | None, key: str, spec: str) -> str:
        if r is None:
            return "-"
        if key in ("cpu_seconds", "other_cpus"):
            return format(statistics.median(r[key]), spec)
        return format(r[key], spec)

    def spread(r: dict | None) -> str:
        return "-" if r is None else f"{r['worst_gbps']:.2f}-{r['best_gbps']:.2f}"

    notes = []
    rows: list[tuple[str, str | None, str | None]] = []
    for name in report["config"]["methods"]:
        m = METHODS[name]
        notes.append(f"  {name}: {m.save_note}")
        if not m.loads:
            rows.append((name, f"save:{name}", None))
        for i, (lname, _) in enumerate(m.loads):
            rows.append((lname, f"save:{name}" if i == 0 else None, f"load:{lname}"))
    for label, skey, lkey in rows:
        s = res.get(skey) if skey else None
        ld = res.get(lkey) if lkey else None
        files = report["methods"].get(label, {}).get("files", "") if skey else ""
        others = f"{fmt(s, 'other_cpus', '.1f')}/{fmt(ld, 'other_cpus', '.1f')}"
        lines.append(
            f"{label:<15}{fmt(s, 'gbps', '.3f'):>10}{fmt(ld, 'gbps', '.3f'):>10}"
            f"{spread(s):>13}{spread(ld):>13}"
            f"{fmt(s, 'median_s', '.2f'):>8}{fmt(ld, 'median_s', '.2f'):>8}"
            f"{fmt(s, 'cpu_seconds', '.2f'):>9}{fmt(ld, 'cpu_seconds', '.2f'):>9}{others:>10}{files!s:>6}"
        )
    lines.append(
        "GB/s and s: medians; min-max: slowest and fastest repeat (GB/s); cpu: this process's CPU seconds (median); "
        "others: CPUs busy\nwith other processes of this machine during the measurement "
        "(save/load, median), a noise gauge"
    )
    return "\n".join(lines + notes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="2GiB", help="total state size, e.g. 512MiB, 2GiB (default 2GiB)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (default: the temp dir)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--methods", default=",".join(ALL_METHODS), help="comma-separated subset of " + ",".join(ALL_METHODS)
    )
    p.add_argument("--chunk-size", help="CheckpointWriter chunk_size (default: the library's)")
    p.add_argument("--write-threads", type=int, help="CheckpointWriter thread_count")
    p.add_argument("--files-per-rank", type=int, help="CheckpointWriter files_per_rank")
    p.add_argument("--read-threads", type=int, help="CheckpointReader thread_count")
    p.add_argument(
        "--quiet",
        type=float,
        default=DEFAULT_QUIET,
        help="before each measurement wait up to this many seconds for other processes to "
        f"leave the CPUs and the disk idle (the machine is shared; default {DEFAULT_QUIET:g}, "
        "as goodput-ckpt bench); 0 disables",
    )
    p.add_argument("--no-check", action="store_true", help="skip comparing loaded values with the source")
    a = p.parse_args(argv)
    methods = [m for m in a.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        p.error(f"unknown methods: {sorted(unknown)}")
    writer_kw: dict[str, Any] = {}
    if a.chunk_size:
        writer_kw["chunk_size"] = parse_size(a.chunk_size)
    if a.write_threads:
        writer_kw["thread_count"] = a.write_threads
    if a.files_per_rank:
        writer_kw["files_per_rank"] = a.files_per_rank
    reader_kw = {"thread_count": a.read_threads} if a.read_threads else {}

    import goodput_ckpt.dcp.reader as rd
    import goodput_ckpt.dcp.writer as wr

    size = parse_size(a.size)
    os.makedirs(a.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="goodput-bench-", dir=a.dir)
    t0 = time.perf_counter()
    state = make_state(size, a.seed)
    print(
        f"state: {state.nbytes / (1 << 30):.3f} GiB in {len(state.flat)} tensors ({state.large} of 1-64 MiB, "
        f"{state.small} under 64 KiB), built in {time.perf_counter() - t0:.1f} s; writing under {base}"
    )
    free = shutil.disk_usage(base).free
    if free < 2.5 * state.nbytes:
        raise SystemExit(f"only {free / GB:.1f} GB free under {base}: need about {2.5 * state.nbytes / GB:.1f}")
    try:
        rep = run(state, methods, a.repeats, base, writer_kw, reader_kw, check=not a.no_check, quiet=a.quiet)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rep["config"] = {
        "size": state.nbytes,
        "tensors": len(state.flat),
        "small_tensors": state.small,
        "seed": a.seed,
        "repeats": a.repeats,
        "dir": a.dir,
        "methods": methods,
        "writer": {
            "chunk_size": writer_kw.get("chunk_size", wr.DEFAULT_CHUNK_SIZE),
            "thread_count": writer_kw.get("thread_count", wr.DEFAULT_WRITE_THREADS),
            "files_per_rank": writer_kw.get("files_per_rank"),
        },
        "reader": {"thread_count": reader_kw.get("thread_count", rd.DEFAULT_READ_THREADS), "task_bytes": rd.TASK_BYTES},
    }
    rep["env"] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "cold_cache": rep["cold_cache"],
    }
    rep["ratios"] = ratios(rep["results"])
    rep["ratios_best"] = ratios(rep["results"], "best_gbps")
    print()
    print(
        f"payload {state.nbytes / GB:.3f} GB; median of {a.repeats}; GB = 1e9 bytes; "
        f"loads {'COLD (files evicted from the page cache before each)' if rep['cold_cache'] else 'WARM (could not evict: no posix_fadvise)'}; "
        f"quiet wait up to {a.quiet:g} s before each step"
    )
    print(f"ours: {rep['config']['writer']} {rep['config']['reader']}")
    print("order: " + "; ".join(f"repeat {i + 1}: {', '.join(o)}" for i, o in enumerate(rep["order"])))
    la = rep["loadavg"]
    print(
        f"load average (1/5/15 min) at start {'/'.join(f'{x:.1f}' for x in la['start'])}, "
        f"at end {'/'.join(f'{x:.1f}' for x in la['end'])} on {os.cpu_count()} CPUs"
    )
    print(table(rep))
    print()
    print(f"{'target':<44}{'median':>8}{'best':>8}{'per repeat min / median / max':>32}")
    for name, r in rep["ratios"].items():
        b = rep["ratios_best"][name]
        cmp = ">=" if r["kind"] == "min" else "<="

        def shown(x: dict[str, Any]) -> str:
            v = f"{x['value'] * 100:.1f}%" if x["kind"] == "max" else f"{x['value']:.2f}x"
            return v + ("" if x["ok"] else "!")

        if r["kind"] == "info":
            tgt = "no target"
        else:
            tgt = f"target {cmp} " + (f"{r['target'] * 100:.0f}%" if r["kind"] == "max" else f"{r['target']}x")
        print(f"{name:<44}{shown(r):>8}{shown(b):>8}{r['per_repeat']:>32}   {tgt}  [{r['of']}]")
    print(
        "(! = target missed; median: ratio of medians; best: ratio of the fastest repeats; per repeat: the speed\n"
        "ratio within each repeat, as goodput-ckpt bench prints it; for the overheads, the hashed/plain speed)"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=2)
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
