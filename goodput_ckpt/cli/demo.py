"""``goodput-ckpt demo``: kill a training job, resume it bit for bit, and report goodput."""

from __future__ import annotations

import argparse
import math

from ..tools.demos.demo import FAILURES
from ..tools.demos.results import DemoReport
from ._demo_tiers import render_tiers
from ._output import Output, human_bytes, table
from ._registry import Command
from .plan import parse_duration


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir",
        default="goodput-demo",
        help="local work directory: logs, fingerprints, timeline (default ./goodput-demo)",
    )
    p.add_argument(
        "--uri", help="checkpoint root: a path, s3://bucket/prefix or a volume path (default DIR/checkpoints)"
    )
    p.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
    p.add_argument(
        "--save-every", type=int, default=20, metavar="N", help="async checkpoint every N steps (default 20)"
    )
    p.add_argument("--width", type=int, default=1024, help="model width: 4 layers of width² parameters (default 1024)")
    p.add_argument(
        "--kill-at", type=int, metavar="STEP", help="SIGKILL the job after this step (default: a save step 40-70%% in)"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the default kill point")
    p.add_argument("--ranks", type=int, metavar="N", help="training ranks (default 2; 4 with --tiers: 2 nodes of 2)")
    tiers = p.add_argument_group("two tiers", "run the same job and failure on one tier and on two, side by side")
    tiers.add_argument(
        "--tiers", action="store_true", help="compare every save persistent with node-local saves + replicas"
    )
    tiers.add_argument(
        "--persist-every", type=int, default=3, metavar="K", help="two tiers: persist every K-th save (default 3)"
    )
    tiers.add_argument(
        "--failure",
        choices=FAILURES,
        default="node",
        help="node: kill the job and delete the last node's local directory (default); job: kill only",
    )
    tiers.add_argument(
        "--node-mtbf",
        type=parse_duration,
        default=4 * 3600.0,
        metavar="DURATION",
        help="the two-level model's MTBF of failures a replica survives (default 4h)",
    )
    tiers.add_argument(
        "--job-mtbf",
        type=parse_duration,
        default=3 * 86400.0,
        metavar="DURATION",
        help="the two-level model's MTBF of failures that need the persistent tier (default 3d)",
    )


#: The options that only the two-tier demo reads, with their defaults.
_TIER_ONLY = {"persist_every": 3, "failure": "node", "node_mtbf": 4 * 3600.0, "job_mtbf": 3 * 86400.0}


def _run(args: argparse.Namespace, out: Output) -> int:
    from ..tools.demos.demo import DemoConfig, run_demo
    from ..tools.demos.demo_tiers import run_tier_demo

    if not args.tiers:
        given = [k for k, v in _TIER_ONLY.items() if getattr(args, k) != v]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --tiers")
    cfg = DemoConfig(
        workdir=args.dir,
        uri=args.uri,
        storage_options=args.options,
        steps=args.steps,
        save_every=args.save_every,
        width=args.width,
        kill_at=args.kill_at,
        seed=args.seed,
        world_size=args.ranks or (4 if args.tiers else 2),
        **{k: getattr(args, k) for k in _TIER_ONLY},
    )
    show = not args.no_progress

    def on_event(kind: str, text: str) -> None:
        if show:
            out.warn(f"==> {text}" if kind == "phase" else f"    {text}" if kind == "step" else text)

    report = run_tier_demo(cfg, on_event) if args.tiers else run_demo(cfg, on_event)
    if out.json_mode:
        out.emit_json(report)
    elif args.tiers:
        render_tiers(report, out)
    else:
        render(report, out)
    return 0 if report.ok else 1


def _pct(part: float, total: float) -> str:
    return f"{100 * part / total:.1f} %" if total > 0 else "-"


def render(r: DemoReport, out: Output) -> None:
    """Print a :class:`~goodput_ckpt.tools.demos.results.DemoReport`."""
    out.print(
        f"\ngoodput-ckpt demo: {r.world_size} ranks on {r.device}, {r.steps} steps, async save every {r.save_every} steps"
    )
    out.print(f"checkpoints: {r.root}\n")
    if r.bit_exact:
        out.print(f"RESUME OK   all {r.values_compared} values (parameters, optimizer, scheduler, every rank's RNG and")
        out.print("            dataloader position) equal the uninterrupted run's, bit for bit")
    else:
        out.print(
            f"RESUME DIFFERS  {len(r.mismatches)} of {r.values_compared} values differ from the uninterrupted run:"
        )
        for m in r.mismatches[:10]:
            out.print(f"  {m}")
    flight = (
        f"while the save of step {r.save_in_flight_at_kill} was still being written (left incomplete, ignored)"
        if r.save_in_flight_at_kill is not None
        else "with no save in flight"
    )
    out.print(f"KILLED      SIGKILL after step {r.killed_after_step}, {flight}")
    out.print(f"RESTARTED   from step {r.restored_step}, the newest complete checkpoint")
    bad = [c for c in r.checkpoints if not c["ok"]]
    sizes = human_bytes(max((c["bytes"] for c in r.checkpoints), default=0))
    verdict = (
        "all verified"
        if not bad
        else f"{len(bad)} FAILED verification: " + ", ".join(f"step {c['step']} {c['status']}" for c in bad)
    )
    out.print(
        f"CHECKPOINTS {len(r.checkpoints)} kept (steps {', '.join(str(c['step']) for c in r.checkpoints)}; {sizes} each), {verdict}\n"
    )

    s = r.seconds
    rows = [
        ["training (the same steps, uninterrupted and without checkpoints)", s["training"]],
        [f"checkpoint stall ({r.saves_kept} saves, {1000 * r.stall_per_save_s:.0f} ms each)", s["stall"]],
        [f"lost work (steps after step {r.restored_step}, redone)", s["lost"]],
        ["restart (kill until the new processes were ready)", s["restart"]],
        ["restore", s["restore"]],
        ["other (steps slowed by background writes, noise)", s["other"]],
        ["total", s["total"]],
    ]
    out.print(f"Where the time of the checkpointed run went ({s['total']:.1f} s):")
    out.print(table(["", "SECONDS", "SHARE"], [[k, f"{v:.2f}", _pct(v, s["total"])] for k, v in rows], right=(1, 2)))
    out.print(f"\nGOODPUT     {100 * r.goodput:.1f} %")
    if not math.isnan(r.sync_save_s):
        ratio = r.sync_save_s / r.stall_per_save_s if r.stall_per_save_s > 0 else float("inf")
        out.print(
            f"With synchronous checkpoints (a blocking dcp.save with torch's FileSystemWriter, "
            f"{r.sync_save_s:.2f} s each, {ratio:.1f}x our stall):\n"
            f"            goodput {100 * r.goodput_sync:.1f} % for the same failure\n"
            f"            ({r.sync_basis})"
        )
    out.print(f"\nLogs: {r.logs}.  Next: goodput-ckpt ls {r.root} --verify")


COMMAND = Command(
    name="demo",
    summary="kill a 2-rank training job, resume it bit for bit, report goodput",
    description=(
        "Train a small FSDP2 model on 2 ranks (gloo on CPU, NCCL when there is a GPU per rank)\n"
        "with a StatefulDataLoader and async checkpoints through CheckpointManager; SIGKILL the\n"
        "job partway through, restart it from the newest complete checkpoint, and check that it\n"
        "ends bit for bit where an uninterrupted run ends. Then verify the checkpoints and report\n"
        "where the time went and the goodput, against synchronous checkpoints. About a minute or\n"
        "two on 2 CPU cores.\n\n"
        "With --tiers: 4 ranks as 2 simulated nodes run the same job and the same failure (a\n"
        "lost node: SIGKILL, then the last node's local directory deleted) twice, with every save\n"
        "persistent and with two tiers (node-local saves, a replica on the other node, every K-th\n"
        "save persisted), and report side by side the stall, the restore and its tiers, the lost\n"
        "work and the goodput, with the two-level model's prediction for the measured costs.\n\n"
        "Exit status: 0 resumed exactly and every checkpoint verified, 1 otherwise."
    ),
    examples=(
        "goodput-ckpt demo",
        "goodput-ckpt demo --tiers",
        "goodput-ckpt demo --uri s3://bucket/demo -o endpoint_url=http://127.0.0.1:9000",
        "goodput-ckpt demo --steps 60 --save-every 10 --width 512 --json",
    ),
    configure=_configure,
    run=_run,
)
