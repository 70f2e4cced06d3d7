"""``goodput-ckpt plan``: the checkpoint interval that maximizes goodput."""

from __future__ import annotations

import argparse
import math
import re
from typing import TYPE_CHECKING

from ._output import Output, human_bytes, table, to_jsonable
from ._registry import Command

if TYPE_CHECKING:
    from ..tools.measure.plan import BenchMeasurement

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


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.2f} %"


def _duration_or_inf(text: str) -> float:
    """A duration, or ``inf`` for "never"."""
    return math.inf if text.strip().lower() in ("inf", "never") else parse_duration(text)


_TWO_LEVEL = ("local_stall", "replicate", "local_restore", "persist_stall", "node_mtbf", "job_mtbf")
_ONE_LEVEL_ONLY = ("stall", "mtbf", "gpus", "gpu_failures_per_hour", "current_interval")


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--from-bench",
        metavar="BENCH_JSON",
        help="take --stall, --persist and --restore from `goodput-ckpt bench --json` output "
        "(flags override; two levels: persist, restore)",
    )
    p.add_argument(
        "--from-timeline",
        metavar="TIMELINE_JSONL",
        help="take --stall, --persist and --restore from a CheckpointManager timeline "
        "(flags override; two levels: persist, restore)",
    )
    p.add_argument(
        "--stall",
        type=parse_duration,
        help="time training blocks per checkpoint (required without --from-bench/--from-timeline)",
    )
    p.add_argument(
        "--persist", type=parse_duration, help="time a background save takes to be durable after the stall (default 0)"
    )
    p.add_argument("--restore", type=parse_duration, help="time to load a checkpoint after a restart (default 0)")
    p.add_argument("--restart", type=parse_duration, default=0.0, help="time to detect a failure and restart the job")
    mtbf = p.add_mutually_exclusive_group()
    mtbf.add_argument("--mtbf", type=parse_duration, help="mean time between failures of the whole job (one level)")
    mtbf.add_argument("--gpus", type=int, help="GPU count (with --gpu-failures-per-hour)")
    p.add_argument("--gpu-failures-per-hour", type=float, help="failure rate of one GPU, per hour")
    p.add_argument("--current-interval", type=parse_duration, help="the interval you use now, for comparison")
    two = p.add_argument_group("two levels (node-local tier with replicas, persistent every k saves; docs/goodput.md)")
    two.add_argument("--local-stall", type=parse_duration, help="time training blocks per local save")
    two.add_argument(
        "--replicate",
        type=parse_duration,
        help="time after that stall until the local copy and its replica are complete",
    )
    two.add_argument(
        "--local-restore", type=parse_duration, help="time to load a checkpoint from the local tier or a replica"
    )
    two.add_argument(
        "--persist-stall",
        type=parse_duration,
        help="extra stall of a save that also goes to the persistent tier (default 0)",
    )
    two.add_argument(
        "--node-mtbf", type=_duration_or_inf, help="MTBF of failures the local tier survives (a lost node); inf: none"
    )
    two.add_argument("--job-mtbf", type=parse_duration, help="mean time between failures that need the persistent tier")
    two.add_argument(
        "--max-persist-every", type=int, default=10_000, help="the largest persist_every searched (default 10000)"
    )


def _run(args: argparse.Namespace, out: Output) -> int:
    from ..tools.measure.plan import PlanInputs, mtbf_from_fleet, plan

    if any(getattr(args, n) is not None for n in _TWO_LEVEL):
        return _run_two_level(args, out)
    if args.mtbf is None:
        if args.gpus is None:
            raise ValueError(
                "give --mtbf, or --gpus with --gpu-failures-per-hour (or --node-mtbf and --job-mtbf for two levels)"
            )
        if args.gpu_failures_per_hour is None:
            raise ValueError("--gpus needs --gpu-failures-per-hour")
        args.mtbf = mtbf_from_fleet(args.gpus, args.gpu_failures_per_hour)
    source, measured = _measured(args)
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
    _print_measured(args, out, source, measured, ("stall", "persist", "restore"))
    rows = [["optimal (Daly)", _fmt(result.optimal_interval), f"{100 * result.goodput_at_optimum:.2f} %"]]
    rows.append(["Young sqrt(2*stall*MTBF)", _fmt(result.young_interval), "-"])
    if result.current_interval is not None:
        rows.append(["current", _fmt(result.current_interval), f"{100 * result.goodput_at_current:.2f} %"])
    out.print(table(["INTERVAL", "EVERY", "GOODPUT"], rows))
    out.print(f"\nMTBF {_fmt(inputs.mtbf)}; goodput change when an input doubles (percentage points):")
    out.print(table(["INPUT", "CHANGE"], [[k, f"{v:+.3f}"] for k, v in result.sensitivity.items()], right=(1,)))
    return 0


def _measured(args: argparse.Namespace) -> tuple[str | None, BenchMeasurement | None]:
    """The bench report or timeline named by --from-bench / --from-timeline, and its name."""
    from ..tools.measure.plan import inputs_from_bench, inputs_from_timeline

    if args.from_bench and args.from_timeline:
        raise ValueError("give --from-bench or --from-timeline, not both")
    if args.from_bench:
        return args.from_bench, inputs_from_bench(args.from_bench)
    if args.from_timeline:
        return args.from_timeline, inputs_from_timeline(args.from_timeline)
    return None, None


def _print_measured(
    args: argparse.Namespace, out: Output, source: str | None, measured: BenchMeasurement | None, names: tuple[str, ...]
) -> None:
    """Which of ``names`` came from the report (those no flag gave), as one line."""
    if measured is not None:
        taken = [f"{n} {_fmt(getattr(measured, n))}" for n in names if getattr(args, n) is None]
        out.print(
            f"from {source} ({measured.method}, {human_bytes(measured.size_bytes)} state on "
            f"{measured.backend}): {', '.join(taken) or 'nothing (every flag given)'}\n"
        )


def _run_two_level(args: argparse.Namespace, out: Output) -> int:
    """The two-level plan: --persist and --restore are the persistent tier's (a bench report or
    timeline of the persistent storage may give them); the local tier's figures are flags."""
    from ..tools.measure.plan_two_level import TwoLevelInputs, plan_two_level

    given = [f"--{n.replace('_', '-')}" for n in _ONE_LEVEL_ONLY if getattr(args, n) is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)}: only for the one-level plan; the two-level plan takes --local-stall, "
            "--persist-stall, --node-mtbf and --job-mtbf instead"
        )
    missing = [f"--{n.replace('_', '-')}" for n in ("local_stall", "node_mtbf", "job_mtbf") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"the two-level plan needs {', '.join(missing)}")
    source, measured = _measured(args)
    timing = {
        n: getattr(args, n) if getattr(args, n) is not None else getattr(measured, n, 0.0)
        for n in ("persist", "restore")
    }
    flags = {n: getattr(args, n) or 0.0 for n in ("replicate", "local_restore", "persist_stall")}
    inputs = TwoLevelInputs(
        local_stall=args.local_stall,
        node_mtbf=args.node_mtbf,
        job_mtbf=args.job_mtbf,
        restart=args.restart,
        max_persist_every=args.max_persist_every,
        **flags,
        **timing,
    )
    result = plan_two_level(inputs)
    if out.json_mode:
        key = "from_timeline" if args.from_timeline else "from_bench"
        doc = to_jsonable(result)
        if math.isinf(inputs.node_mtbf):
            doc["inputs"]["node_mtbf"] = None  # JSON has no infinity: null is "no node failures"
        out.emit_json({**doc, key: None if measured is None else measured.to_dict()})
        return 0
    _print_measured(args, out, source, measured, ("persist", "restore"))
    rows = [
        [
            "two levels (best)",
            _fmt(result.local_interval),
            result.persist_every,
            _fmt(result.persistent_period),
            _pct(result.goodput),
        ]
    ]
    rows += [
        [
            f"  persist_every {o.persist_every}",
            _fmt(o.local_interval),
            o.persist_every,
            _fmt(o.persistent_period),
            _pct(o.goodput),
        ]
        for o in result.options
    ]
    one = result.one_level
    rows.append(["one level (Daly)", "-", "-", _fmt(one.optimal_interval), _pct(one.goodput_at_optimum)])
    out.print(table(["SCHEDULE", "LOCAL EVERY", "PERSIST_EVERY", "PERSISTENT EVERY", "GOODPUT"], rows, right=(2,)))
    node = "never" if math.isinf(inputs.node_mtbf) else _fmt(inputs.node_mtbf)
    out.print(f"\nnode MTBF {node}, job MTBF {_fmt(inputs.job_mtbf)}; the local interval is set by: {result.bound}")
    out.print(f"gain over one level: {result.gain:+.3f} percentage points")
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
        "With --local-stall, --node-mtbf and --job-mtbf it plans two levels instead: the local\n"
        "interval and persist_every for a node-local tier with replicas, against one level.\n"
        "See docs/goodput.md."
    ),
    examples=(
        "goodput-ckpt plan --stall 2s --restore 90s --restart 5m --mtbf 3h",
        "goodput-ckpt plan --stall 2s --persist 40s --gpus 4096 --gpu-failures-per-hour 2e-5 --current-interval 1h",
        "goodput-ckpt plan --stall 2s --mtbf 12h --json",
        "goodput-ckpt plan --from-bench bench.json --restart 5m --mtbf 3h",
        "goodput-ckpt plan --from-timeline /ckpt/run/goodput-timeline.jsonl --restart 5m --mtbf 3h",
        "goodput-ckpt plan --local-stall 1s --replicate 5s --local-restore 20s --persist-stall 10s --persist 2m "
        "--restore 5m --restart 5m --node-mtbf 6h --job-mtbf 7d",
    ),
    configure=_configure,
    run=_run,
    uses_stores=False,
)
