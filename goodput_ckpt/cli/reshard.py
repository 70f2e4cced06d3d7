"""``goodput-ckpt reshard SRC DST --world-size M``."""

from __future__ import annotations

import argparse

from ._main_helpers import add_two_store_options, two_store_options
from ._output import Output, escape, human_bytes, human_rate, human_seconds
from ._registry import Command


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="checkpoint to read")
    p.add_argument("dst", help="new checkpoint location")
    p.add_argument(
        "--world-size", "-w", type=int, required=True, metavar="M", help="ranks of the output (1 consolidates)"
    )
    p.add_argument(
        "--rank-state",
        choices=("auto", "keep", "drop"),
        default="auto",
        help="per-rank RNG/dataloader entries: keep them, drop them, or auto (keep when the world "
        "size is unchanged, else refuse and ask)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="parallel chunk writers (default 4)")
    p.add_argument(
        "--chunk-size", type=_size, default=None, metavar="SIZE", help="hash chunk size of the output (default 8MiB)"
    )
    p.add_argument("--no-verify", action="store_true", help="do not check the source's chunk hashes while reading")
    add_two_store_options(p)


def _size(text: str) -> int:
    from ._output import parse_size

    return parse_size(text)


def _run(args: argparse.Namespace, out: Output) -> int:
    from ..tools.ops.reshard import reshard_checkpoint

    src_opts, dst_opts = two_store_options(args)
    r = reshard_checkpoint(
        args.src,
        args.dst,
        world_size=args.world_size,
        rank_state=args.rank_state,
        overwrite=args.overwrite,
        thread_count=args.threads,
        chunk_size=args.chunk_size,
        verify=not args.no_verify,
        progress=out.progress(),
        src_options=src_opts,
        dst_options=dst_opts,
    )
    if out.json_mode:
        out.emit_json(r)
    else:
        out.print(
            f"resharded {escape(r.src)} ({r.src_world_size} rank{'s' if r.src_world_size != 1 else ''}) -> {escape(r.dst)} "
            f"({r.world_size} rank{'s' if r.world_size != 1 else ''}): {r.tensors} tensors, {r.objects} objects, "
            f"{human_bytes(r.tensor_bytes)} in {human_seconds(r.seconds)} ({human_rate(r.tensor_bytes, r.seconds)})"
        )
        if r.per_rank_kept or r.per_rank_dropped:
            out.print(
                f"per-rank state ({r.rank_state}): {len(r.per_rank_kept)} kept, {len(r.per_rank_dropped)} dropped"
            )
    return 0


COMMAND = Command(
    name="reshard",
    summary="rewrite a checkpoint for M ranks (dim-0 split, as FSDP2 Shard(0))",
    description=(
        "Rewrite a checkpoint so that each of M ranks reads one contiguous region per tensor: an\n"
        "even split along dim 0, as FSDP2's Shard(0) does (torch.chunk). --world-size 1\n"
        "consolidates to whole tensors. Streams tensor by tensor with memory of a few chunks;\n"
        "source chunks are verified as they are read and the output is hashed as it is written.\n"
        "The result loads with dcp.load + CheckpointReader at any world size.\n\n"
        "Per-rank RNG and dataloader entries (rng.rows, dataloader.rows, keys like rng.rank3.*\n"
        "or dataloader.rank_3 ...) cannot be split: --rank-state keep copies them under their old\n"
        "keys, drop leaves them out, auto keeps them when the world size is unchanged and refuses\n"
        "otherwise."
    ),
    examples=(
        "goodput-ckpt reshard /ckpt/step_00001000 /ckpt/step_00001000-w8 --world-size 8",
        "goodput-ckpt reshard /ckpt/step_00001000 /tmp/full --world-size 1 --rank-state drop",
    ),
    configure=_configure,
    run=_run,
    uses_stores=False,
)
