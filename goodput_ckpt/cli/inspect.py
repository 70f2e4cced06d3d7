"""``goodput-ckpt inspect URI``."""

from __future__ import annotations

import argparse

from ._output import Output, escape, human_bytes, table
from ._registry import Command

#: ``tools.ops._dcp_foreign.DCP_FORMAT``, not imported from there: that module imports torch.
DCP_FORMAT = "torch-dcp"


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri", help="checkpoint location")
    p.add_argument(
        "-k",
        "--keys",
        action="append",
        default=None,
        metavar="GLOB",
        help="list only keys matching this shell-style glob (repeatable), e.g. 'model.layers.*'",
    )
    p.add_argument("--summary", action="store_true", help="omit the item table")


def _run(args: argparse.Namespace, out: Output) -> int:
    from ..tools.ops.inspect import inspect_checkpoint

    report = inspect_checkpoint(args.uri, pattern=args.keys, **args.options)
    if out.json_mode:
        out.emit_json(report)
    else:
        _render(report, out, items=not args.summary)
    for p in report.problems:
        out.warn(f"warning: {escape(p)} (run `goodput-ckpt verify {escape(report.uri)}`)")
    return 0 if not report.problems else 1


def _render(r, out: Output, *, items: bool) -> None:
    out.print(escape(r.uri))
    if r.format == DCP_FORMAT:
        out.print(
            f"  format      {r.format} (torch DCP's FileSystemWriter layout, metadata version {escape(r.version or '?')})"
        )
    else:
        out.print(
            f"  format      {r.format}, format version {r.version} (written by goodput-ckpt {escape(r.library_version or '?')}, torch {escape(r.torch_version or '?')})"
        )
        if r.training_schema is not None:
            out.print(f"  training    CheckpointManager state, training-state schema {r.training_schema}")
        out.print(f"  created     {escape(r.created_at or '?')}")
    out.print(f"  step        {r.step if r.step is not None else '-'}")
    out.print(f"  world size  {r.world_size or '-'}")
    hashes = f"hash chunks of {human_bytes(r.chunk_size)}" if r.chunk_size else "no hashes"
    out.print(f"  files       {r.files}, {human_bytes(r.file_bytes)} ({hashes})")
    if r.referenced_bytes:  # an incremental save: what it wrote, what earlier steps hold for it
        out.print(
            f"  written     {human_bytes(r.file_bytes - r.referenced_bytes)}; referenced "
            f"{human_bytes(r.referenced_bytes)} in {', '.join(r.bases)}"
        )
    out.print(
        f"  items       {r.tensors} tensors ({human_bytes(r.tensor_bytes)}), {r.objects} objects ({human_bytes(r.object_bytes)})"
    )
    out.print()
    out.print(
        table(
            ["SECTION", "TENSORS", "OBJECTS", "BYTES"],
            [[s.name, s.tensors, s.objects, human_bytes(s.bytes)] for s in r.sections],
            right=(1, 2, 3),
        )
    )
    if items:
        out.print()
        rows = [
            [
                i.key,
                i.dtype or "object",
                "x".join(map(str, i.shape)) if i.shape else ("()" if i.kind == "tensor" else "-"),
                i.shards,
                human_bytes(i.bytes),
            ]
            for i in r.items
        ]
        out.print(table(["KEY", "DTYPE", "SHAPE", "SHARDS", "BYTES"], rows, right=(3, 4)))
        if r.pattern is not None:
            out.print(f"({len(r.items)} of {r.tensors + r.objects} items match {escape(' or '.join(r.pattern))})")


COMMAND = Command(
    name="inspect",
    summary="show a checkpoint's version, step, world size, sections and items",
    description=(
        "Describe a checkpoint from its manifest: format version, step, world size, the sections\n"
        "(model, optimizer, rng, dataloader, extra, by the first component of each key), totals,\n"
        "and a table of items (key, dtype, shape, shards, bytes). No data is read; missing or\n"
        "resized files are reported as warnings (exit status 1)."
    ),
    examples=(
        "goodput-ckpt inspect /ckpt/step_00001000",
        "goodput-ckpt inspect /ckpt/step_00001000 --keys 'optim.*' --keys 'model.embed*'",
        "goodput-ckpt inspect /ckpt/step_00001000 --summary --json",
    ),
    configure=_configure,
    run=_run,
)
