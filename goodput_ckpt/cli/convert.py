"""``goodput-ckpt convert SRC DST --to FORMAT``."""

from __future__ import annotations

import argparse

from ._main_helpers import add_two_store_options, two_store_options
from ._output import Output, escape, human_bytes, human_rate, human_seconds, parse_size
from ._registry import Command

_FORMATS = ("goodput", "dcp", "torch", "safetensors")


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="input: a checkpoint directory, a .pt file, a .safetensors file or directory")
    p.add_argument("dst", help="output location (a directory; a file for torch and NAME.safetensors)")
    p.add_argument("--to", required=True, choices=_FORMATS, help="output format")
    p.add_argument(
        "--from", dest="source_format", choices=_FORMATS, default=None, help="input format (default: detected)"
    )
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="unpickle torch inputs without weights_only restrictions (only for files you trust)",
    )
    p.add_argument(
        "--shard-size",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="safetensors directory output: bytes per shard, HF-style (e.g. 5GB)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace what is at DST")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="parallel reads/writes (default 4)")
    p.add_argument(
        "--chunk-size", type=parse_size, default=None, metavar="SIZE", help="goodput output: hash chunk size"
    )
    p.add_argument("--no-verify", action="store_true", help="goodput input: do not check chunk hashes while reading")
    sel = p.add_argument_group(
        "what to export (default: a CheckpointManager checkpoint converted to safetensors "
        "exports its model alone, 'model.' stripped, tied weights once; otherwise everything)"
    )
    only = sel.add_mutually_exclusive_group()
    only.add_argument(
        "--model-only", action="store_true", help="only the model's keys, 'model.' stripped (a Hugging Face model)"
    )
    only.add_argument("--all", action="store_true", help="every key as stored (optimizer, RNG, loader state included)")
    only.add_argument(
        "--keys",
        action="append",
        default=None,
        metavar="PATTERN",
        help="only keys matching this fnmatch pattern (repeatable), e.g. 'model.*'",
    )
    sel.add_argument(
        "--strip-prefix", default=None, metavar="P", help="remove P from the exported keys' names (e.g. model.)"
    )
    add_two_store_options(p)


def _run(args: argparse.Namespace, out: Output) -> int:
    from ..tools.ops.convert import convert_checkpoint

    src_opts, dst_opts = two_store_options(args)
    r = convert_checkpoint(
        args.src,
        args.dst,
        to=args.to,
        source_format=args.source_format,
        trust_pickle=args.trust_pickle,
        overwrite=args.overwrite,
        shard_size=args.shard_size,
        chunk_size=args.chunk_size,
        thread_count=args.threads,
        verify=not args.no_verify,
        progress=out.progress(),
        src_options=src_opts,
        dst_options=dst_opts,
        select="model" if args.model_only else "all" if args.all else "auto",
        keys=args.keys,
        strip_prefix=args.strip_prefix,
    )
    if out.json_mode:
        out.emit_json(r)
    else:
        out.print(
            f"converted {escape(r.src)} ({r.src_format}) -> {escape(r.dst)} ({r.dst_format}): {r.tensors} tensors, {r.objects} objects, "
            f"{human_bytes(r.tensor_bytes)} in {human_seconds(r.seconds)} ({human_rate(r.tensor_bytes, r.seconds)})"
        )
        if r.selection == "model":
            out.print("exported the model alone, 'model.' stripped (--all exports everything)")
        if r.tied_dropped:
            out.print("tied weights written once; left out: " + ", ".join(escape(k) for k in r.tied_dropped))
        out.print("files: " + ", ".join(escape(f) for f in r.files))
    return 0


COMMAND = Command(
    name="convert",
    summary="convert between goodput, torch DCP, torch.save and safetensors",
    description=(
        "Convert a checkpoint between formats, streaming with bounded memory:\n"
        "  goodput      this library's format (a directory with manifest.json)\n"
        "  dcp          torch DCP's FileSystemWriter layout (.metadata + __*.distcp)\n"
        "  torch        a single torch.save file (local paths only)\n"
        "  safetensors  NAME.safetensors, or a directory of HF-style shards with\n"
        "               model.safetensors.index.json; non-tensor values go to a JSON sidecar\n"
        "               (NAME.objects.json / model.objects.json)\n"
        "The input format is detected. torch inputs are unpickled with weights_only=True\n"
        "unless --trust-pickle is given. Tensors are preserved exactly in every direction.\n"
        "A CheckpointManager checkpoint converted to safetensors becomes a Hugging Face model:\n"
        "its model alone, 'model.' stripped, tied weights written once (--all keeps everything)."
    ),
    examples=(
        "goodput-ckpt convert /ckpt/step_00001000 /export/dcp --to dcp",
        "goodput-ckpt convert /export/dcp /ckpt/imported --to goodput",
        "goodput-ckpt convert /ckpt/step_00001000 model.safetensors --to safetensors",
        "goodput-ckpt convert /ckpt/step_00001000 hf_model/ --to safetensors --shard-size 5GB",
        "goodput-ckpt convert pytorch_model.bin /ckpt/imported --to goodput",
        "goodput-ckpt convert /ckpt/step_00001000 export/ --to safetensors --keys 'model.*' --strip-prefix model.",
    ),
    configure=_configure,
    run=_run,
    uses_stores=False,
)
