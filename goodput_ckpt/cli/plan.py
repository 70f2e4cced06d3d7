"""``goodput-ckpt plan``: the checkpoint interval that maximizes goodput."""

from __future__ import annotations

import argparse
import re

from ._output import Output, table
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
    return f"{seconds:.1f} s"


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stall", type=parse_duration, required=True, help="time training blocks per checkpoint")
    p.add_argument("--persist", type=parse_duration, default=0.0, help="time a background save takes to be durable after the stall")
    p.add_argument("--restore", type=parse_duration, default=0.0, help="time to load a checkpoint after a restart")
    p.add_argument("--restart", type=parse_duration, default=0.0, help="time to detect a failure and restart the job")
    mtbf = p.add_mutually_exclusive_group(required=True)
    mtbf.add_argument("--mtbf", type=parse_duration, help="mean time between failures of the whole job")
    mtbf.add_argument("--gpus", type=int, help="GPU count (with --gpu-failures-per-hour)")
    p.add_argument("--gpu-failures-per-hour", type=float, help="failure rate of one GPU, per hour")
    p.add_argument("--current-interval", type=parse_duration, help="the interval you use now, for comparison")


def _run(args: argparse.Namespace, out: Output) -> int:
    from ..tools.plan import PlanInputs, mtbf_from_fleet, plan

    if args.mtbf is None:
        if args.gpu_failures_per_hour is None:
            raise ValueError("--gpus needs --gpu-failures-per-hour")
        args.mtbf = mtbf_from_fleet(args.gpus, args.gpu_failures_per_hour)
    inputs = PlanInputs(
        stall=args.stall, mtbf=args.mtbf, restore=args.restore, restart=args.restart,
        persist=args.persist, current_interval=args.current_interval,
    )  # fmt: skip
    result = plan(inputs)
    if out.json_mode:
        out.emit_json(result)
        return 0
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
        "Durations take units: 250ms, 90s, 5m, 3h, 2d. See docs/goodput.md."
    ),
    examples=(
        "goodput-ckpt plan --stall 2s --restore 90s --restart 5m --mtbf 3h",
        "goodput-ckpt plan --stall 2s --persist 40s --gpus 4096 --gpu-failures-per-hour 2e-5 --current-interval 1h",
        "goodput-ckpt plan --stall 2s --mtbf 12h --json",
    ),
    configure=_configure,
    run=_run,
    uses_stores=False,
)
