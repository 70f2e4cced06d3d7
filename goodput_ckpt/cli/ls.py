"""``goodput-ckpt ls ROOT``."""

from __future__ import annotations

import argparse

from ._output import Output, escape, human_bytes, table
from ._registry import Command


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("root", help="manager root holding step_XXXXXXXX checkpoints")
    p.add_argument(
        "--verify", action="store_true", help="verify each complete checkpoint (hashes) so corrupt ones show"
    )
    p.add_argument("--quick", action="store_true", help="with --verify: check sizes only")
    p.add_argument(
        "--local-dir",
        metavar="DIR",
        help="the node-local tier of a two-tier manager ({node} allowed): show which tiers hold each step",
    )


def _run(args: argparse.Namespace, out: Output) -> int:
    from ..tools.ops.ls import list_checkpoints

    report = list_checkpoints(
        args.root,
        verify=args.verify,
        quick=args.quick,
        progress=out.progress(),
        local_dir=args.local_dir,
        **args.options,
    )
    if out.json_mode:
        out.emit_json(report)
    else:
        rows = [[c.step, c.status, c.created_at or "-", human_bytes(c.bytes), c.files] for c in report.checkpoints]
        headers = ["STEP", "STATUS", "CREATED", "SIZE", "FILES"]
        if any(c.referenced for c in report.checkpoints):  # incremental saves: bytes in earlier steps
            headers.append("REFERENCED")
            for row, c in zip(rows, report.checkpoints):
                row.append(human_bytes(c.referenced) if c.referenced else "-")
        if args.local_dir is not None:
            headers.append("TIERS")
            for row, c in zip(rows, report.checkpoints):
                row.append(", ".join(c.tiers) or "-")
        out.print(table(headers, rows, right=(0, 3, 4)))
        latest = report.latest_complete
        out.print(
            f"{len(report.checkpoints)} checkpoint(s) under {escape(report.root)}; latest complete: {latest if latest is not None else 'none'}"
        )
        local = [c.step for c in report.checkpoints if any(t.startswith("node ") for t in c.tiers)]
        if args.local_dir is not None:
            out.print(
                f"newest on the local tier: {max(local) if local else 'none'} (a restore takes the newest step all ranks can rebuild)"
            )
        for c in report.checkpoints:
            if c.status == "corrupt":
                for p in c.problems:
                    out.warn(f"step {c.step}: {escape(p)}")
    corrupt = any(c.status in ("corrupt", "unsupported") for c in report.checkpoints)
    return 1 if args.verify and corrupt else 0


COMMAND = Command(
    name="ls",
    summary="list the checkpoints under a manager root, with step, time, size and status",
    description=(
        "List the step_XXXXXXXX checkpoints under a CheckpointManager root with their step,\n"
        "creation time, size and status: complete, incomplete (no manifest: a save running, failed\n"
        "or interrupted) or corrupt (bad manifest). With --verify every complete checkpoint is\n"
        "verified too, and damaged ones show as corrupt (exit status 1). Hand-written step_N\n"
        "directories are listed too. A root that is missing or holds no step directory: exit 2."
    ),
    examples=(
        "goodput-ckpt ls /ckpt",
        "goodput-ckpt ls /ckpt --verify",
        "goodput-ckpt ls s3://bucket/run7 --json",
        "goodput-ckpt ls s3://bucket/run7 --local-dir '/local_disk0/ckpt'",
    ),
    configure=_configure,
    run=_run,
)
