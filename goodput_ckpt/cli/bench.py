"""``goodput-ckpt bench [URI]``."""

from __future__ import annotations

import argparse

from ._output import Output, human_bytes, parse_size, table
from ._registry import Command


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "uri",
        nargs="?",
        default=None,
        help="where to write: a directory (default: the current one), a path on a mounted volume, "
        "or s3://bucket/prefix; a goodput-bench-* child is created there and removed",
    )
    p.add_argument(
        "--size",
        type=parse_size,
        default="1GiB",
        metavar="SIZE",
        help="synthetic state size, e.g. 256MiB, 4GiB, 1.5GB (default 1GiB; needs about 3x in memory)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, metavar="N", help="measurements per figure; medians shown (default 3)"
    )
    p.add_argument(
        "--threads", type=int, default=None, metavar="N", help="threads of goodput's writer, reader and verify"
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        metavar="N",
        help="thread_count of torch's writer (default: torch's default, 1)",
    )
    p.add_argument(
        "--quiet",
        type=float,
        default=None,
        metavar="SECONDS",
        help="before each timed step wait at most this long for other processes to leave the CPUs "
        "and the disk idle (default 10; 0: do not wait)",
    )
    p.add_argument("--keep", action="store_true", help="leave the last repeat's checkpoints in place")
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="also draw a bar chart (PNG) here; needs matplotlib: pip install 'goodput-ckpt[plot]'",
    )


def _run(args: argparse.Namespace, out: Output) -> int:
    from ..tools.measure.bench import bench
    from ._main import EXIT_USAGE

    if args.plot:
        from ..tools.measure._bench_plot import require_matplotlib

        try:
            require_matplotlib()  # before the run, not after minutes of it
        except ImportError as e:
            out.warn(f"goodput-ckpt bench: error: {e}")  # a usage error: nothing ran
            return EXIT_USAGE
    report = bench(
        args.uri,
        size=args.size,
        repeats=args.repeats,
        thread_count=args.threads,
        torch_thread_count=args.torch_threads,
        keep=args.keep,
        **({} if args.quiet is None else {"quiet": args.quiet}),
        progress=None if args.no_progress else out.note,
        bar=out.progress(),
        **args.options,
    )
    if args.plot:
        from ..tools.measure._bench_plot import plot_report

        plot_report(report, args.plot)
    if out.json_mode:
        out.emit_json(report.to_json())
        return 0
    render(report, out)
    if args.plot:
        out.print(f"plot: {args.plot}")
    return 0


def _gbps(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def render(report, out: Output) -> None:
    rows = []
    for m in report.methods:
        if not m.available:
            rows.append([m.name, "n/a", "n/a", "n/a", "n/a", "n/a"])
            continue
        verify = _gbps(m.verify_gbps) if m.verify_s else (m.verify_reason or "-")
        rows.append(
            [
                m.name,
                _gbps(m.save_gbps),
                _gbps(m.load_gbps),
                _secs(m.median("save_s")),
                _secs(m.median("stall_s")),
                verify,
            ]
        )
    r = report.ratios
    rows.append(["ours/torch", _ratio(r["save_gbps"]), _ratio(r["load_gbps"]), "-", _ratio(r["stall_s"]), "-"])
    out.print(
        table(["METHOD", "SAVE GB/s", "LOAD GB/s", "SAVE s", "STALL s", "VERIFY GB/s"], rows, right=(1, 2, 3, 4, 5))
    )
    out.print()
    for m in report.methods:
        out.print(f"{m.name + ':':<9}{m.writer} / {m.reader}" + (f": {m.reason}" if m.reason else ""))
    spreads = [f"{k.split('_')[0]} {r.text()}" for k, r in report.ratio_spreads.items() if r is not None]
    if spreads:
        out.print(f"per repeat: ours/torch min / median / max: {', '.join(spreads)}")
    if report.order:
        out.print("order:   " + "; ".join(f"{i + 1}: {', '.join(o)}" for i, o in enumerate(report.order)))
    if report.loadavg:
        out.print(
            "load avg: "
            + " -> ".join("/".join(f"{x:.1f}" for x in la) for la in report.loadavg)
            + f" (1/5/15 min, start -> end; {report.host.get('cpus')} CPUs)"
        )
    cache = {
        True: "loads and verify read from storage (page cache evicted)",
        False: "page cache NOT evicted (no posix_fadvise here): loads may be served from memory",
        None: "remote storage",
    }[report.cold_cache]
    where = f"kept: {', '.join(report.kept)}" if report.kept else "removed after the run"
    out.print(
        f"state:   {human_bytes(report.size_bytes)} ({report.size_bytes / 1e9:.3f} GB) in {report.tensors} tensors; "
        f"median of {report.repeats} repeat{'s' if report.repeats != 1 else ''}; {cache}"
    )
    out.print(f"where:   {report.root} ({report.backend}); {where}")
    out.print(
        "GB = 1e9 bytes. SAVE s: a synchronous dcp.save, until durable, right after a warm-up save.\n"
        "STALL s: how long dcp.async_save blocks the caller (measured after every save and load).\n"
        "ours/torch: above 1 is faster for GB/s, below 1 is a shorter stall; the table's row is the ratio\n"
        "of the medians, 'per repeat' the ratio within each repeat."
    )


COMMAND = Command(
    name="bench",
    summary="measure save, load, stall and verify throughput on your storage, beside torch's writers",
    description=(
        "Save and load a synthetic model-plus-optimizer state (--size) with goodput-ckpt's\n"
        "CheckpointWriter/CheckpointReader and with torch's FileSystemWriter/FileSystemReader\n"
        "(FsspecWriter/FsspecReader for URLs), and report for each: save and load GB/s, the stall\n"
        "of dcp.async_save, and verify GB/s. Loads read from storage, not from the page cache.\n"
        "Writes under a goodput-bench-* child of URI (default: the current directory) and removes\n"
        "it afterwards unless --keep. The --json document feeds `goodput-ckpt plan --from-bench`."
    ),
    examples=(
        "goodput-ckpt bench",
        "goodput-ckpt bench /mnt/checkpoints --size 4GiB --repeats 5",
        "goodput-ckpt bench s3://bucket/scratch -o endpoint_url=http://127.0.0.1:9000 -o addressing_style=path",
        "goodput-ckpt bench --size 256MiB --json > bench.json && goodput-ckpt plan --from-bench bench.json --mtbf 3h",
        "goodput-ckpt bench --plot bench.png",
    ),
    configure=_configure,
    run=_run,
)
