"""``goodput-ckpt plan``: the checkpoint interval that maximizes goodput."""

from __future__ import annotations

import argparse
import re

from ._output import Output, human_bytes, table, to_jsonable
from ._registry import Command

_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``250ms``, ``5m``, ``1.5h`` or ``2d``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-z]*)\s*", text)
    if not m or m.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a duration such as 90s, 5m or 3h, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds:.3f} s"


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-bench", metavar="BENCH_JSON",
                   help="take --stall, --persist and --restore from `goodput-ckpt bench --json` output (flags override)")  # fmt: skip
    p.add_argument("--from-timeline", metavar="TIMELINE_JSONL",
                   help="take --stall, --persist and --restore from a CheckpointManager timeline (flags override)")  # fmt: skip
    p.add_argument("--stall", type=parse_duration, help="time training blocks per checkpoint (required without --from-bench/--from-timeline)")
    p.add_argument("--persist", type=parse_duration, help="time a background save takes to be durable after the stall (default 0)")
    p.add_argument("--restore", type=parse_duration, help="time to load a checkpoint after a restart (default 0)")
    p.add_argument("--restart", type=parse_duration, default=0.0, help="time to detect a failure and restart the job")
    mtbf = p.add_mutually_exclusive_group(required=True)
    mtbf.add_argument("--mtbf", type=parse_duration, help="mean time between failures of the whole job")
    mtbf.add_argument("--gpus", type=int, help="GPU count (with --gpu-failures-per-hour)")
    p.add_argument("--gpu-failures-per-hour", type=float, help="failure rate of one GPU, per hour")
    p.add_argument("--current-interval", type=parse_duration, help="the interval you use now, for comparison")


def _run(args: argparse.Namespace, out: Output) -> int:
    from ..tools.plan import PlanInputs, inputs_from_bench, inputs_from_timeline, mtbf_from_fleet, plan

    if args.mtbf is None:
        if args.gpu_failures_per_hour is None:
            raise ValueError("--gpus needs --gpu-failures-per-hour")
        args.mtbf = mtbf_from_fleet(args.gpus, args.gpu_failures_per_hour)
    if args.from_bench and args.from_timeline:
        raise ValueError("give --from-bench or --from-timeline, not both")
    source = args.from_bench or args.from_timeline
    if args.from_bench:
        measured = inputs_from_bench(args.from_bench)
    elif args.from_timeline:
        measured = inputs_from_timeline(args.from_timeline)
    else:
        measured = None
    timing = {}
    for name in ("stall", "persist", "restore"):
        given = getattr(args, name)
        timing[name] = given if given is not None else getattr(measured, name, 0.0)
    if args.stall is None and measured is None:
        raise ValueError("--stall is required (or --from-bench BENCH_JSON, or --from-timeline TIMELINE_JSONL)")
    inputs = PlanInputs(mtbf=args.mtbf, restart=args.restart, current_interval=args.current_interval, **timing)
    result = plan(inputs)
    if out.json_mode:
        key = "from_timeline" if args.from_timeline else "from_bench"
        out.emit_json({**to_jsonable(result), key: None if measured is None else measured.to_dict()})
        return 0
    if measured is not None:
        taken = [f"{n} {_fmt(getattr(measured, n))}" for n in ("stall", "persist", "restore") if getattr(args, n) is None]
        out.print(f"from {source} ({measured.method}, {human_bytes(measured.size_bytes)} state on "
                  f"{measured.backend}): {', '.join(taken) or 'nothing (every flag given)'}\n")  # fmt: skip
    rows = [["optimal (Daly)", _fmt(result.optimal_interval), f"{100 * result.goodput_at_optimum:.2f} %"]]
    rows.append(["Young sqrt(2*stall*MTBF)", _fmt(result.young_interval), "-"])
    if result.current_interval is not None:
        rows.append(["current", _fmt(result.current_interval), f"{100 * result.goodput_at_current:.2f} %"])
    out.print(table(["INTERVAL", "EVERY", "GOODPUT"], rows))
    out.print(f"\nMTBF {_fmt(inputs.mtbf)}; goodput change when an input doubles (percentage points):")
    out.print(table(["INPUT", "CHANGE"], [[k, f"{v:+.3f}"] for k, v in result.sensitivity.items()], right=(1,)))
    return 0


COMMAND = Command(
    name="plan",
    summary="choose the checkpoint interval that maximizes goodput",
    description=(
        "Compute the checkpoint interval that maximizes expected goodput (Daly's higher-order\n"
        "optimum of G(t) = t/(t+stall) * (1 - (restart + restore + (t+stall)/2 + persist)/MTBF)),\n"
        "the goodput there and at your current interval, and how much each input matters.\n"
        "Durations take units: 250ms, 90s, 5m, 3h, 2d. --from-bench takes stall, persist and\n"
        "restore from `goodput-ckpt bench --json` (run it with your checkpoint's size per node).\n"
        "See docs/goodput.md."
    ),
    examples=(
        "goodput-ckpt plan --stall 2s --restore 90s --restart 5m --mtbf 3h",
        "goodput-ckpt plan --stall 2s --persist 40s --gpus 4096 --gpu-failures-per-hour 2e-5 --current-interval 1h",
        "goodput-ckpt plan --stall 2s --mtbf 12h --json",
        "goodput-ckpt plan --from-bench bench.json --restart 5m --mtbf 3h",
        "goodput-ckpt plan --from-timeline /ckpt/run/goodput-timeline.jsonl --restart 5m --mtbf 3h",
    ),
    configure=_configure,
    run=_run,
    uses_stores=False,
)
