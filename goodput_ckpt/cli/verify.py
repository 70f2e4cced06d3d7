"""``goodput-ckpt verify URI``."""

from __future__ import annotations

import argparse

from ._output import Output, escape, human_bytes, human_rate, human_seconds
from ._registry import Command


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri", help="checkpoint location (a directory, file:// or another store URI)")
    p.add_argument("--quick", action="store_true", help="check the manifest and file sizes only, do not hash")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="parallel reads (default 8)")


def _run(args: argparse.Namespace, out: Output) -> int:
    from ..tools.ops.verify import verify_checkpoint

    report = verify_checkpoint(
        args.uri, quick=args.quick, thread_count=args.threads, progress=out.progress(), **args.options
    )
    if out.json_mode:
        out.emit_json(report)
    else:
        render(report, out)
    return 0 if report.ok else 1


def render(report, out: Output) -> None:
    what = (
        "sizes checked"
        if report.quick or report.notes
        else f"{human_bytes(report.bytes_hashed)} hashed in {human_seconds(report.seconds)} ({human_rate(report.bytes_hashed, report.seconds)})"
    )
    fmt = f"format version {report.version}" if report.version is not None else escape(report.format)
    if report.ok:
        out.print(
            f"OK  {escape(report.uri)}: {fmt}, world size {report.world_size or '-'}, {report.files} file(s), {what}"
        )
    else:
        n = len(report.problems)
        out.print(f"{report.status.upper()}  {escape(report.uri)}: {n} problem{'s' if n != 1 else ''}")
        for p in report.problems:
            out.print(f"  [{escape(p.kind)}] {escape(p.message)}")
    for w in report.warnings:
        out.print(f"  warning: {escape(w.message)}")
    for n in report.notes:
        out.print(f"  note: {escape(n)}")


COMMAND = Command(
    name="verify",
    summary="check a checkpoint: manifest, file sizes and every chunk's blake3",
    description=(
        "Check a checkpoint without loading it: the manifest's schema and self-consistency, that\n"
        "every data file exists with its recorded size, and (unless --quick) the blake3 digest of\n"
        "every chunk, read in parallel. Every problem is reported with its file, byte range and\n"
        "the keys affected. Needs no GPU and no process group.\n\n"
        "Exit status: 0 ok, 1 corrupt/incomplete/unsupported, 2 no checkpoint or usage error."
    ),
    examples=(
        "goodput-ckpt verify /ckpt/step_00001000",
        "goodput-ckpt verify /ckpt/step_00001000 --quick",
        "goodput-ckpt verify /ckpt/step_00001000 --json | jq .problems",
    ),
    configure=_configure,
    run=_run,
)
