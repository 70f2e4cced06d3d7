"""``goodput-ckpt``: argument parsing, dispatch, and turning errors into exit codes."""

from __future__ import annotations

import argparse
import json
import linecache
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from .._version import __version__
from ..errors import OVERWRITE_HINT, CheckpointError, CheckpointExistsError, CheckpointNotFoundError, find_interrupt
from ..storage.base import redact
from ._output import Output, StdoutClosed, escape, to_jsonable
from ._registry import Command, load_commands

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_PIPE", "EXIT_USAGE", "build_parser", "main"]

#: Exit codes: the check passed / the check (or the work) failed / usage error or nothing there.
#: Every error is one of them with a message; --debug adds the traceback.
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: stdout's reader went away (``| head``): quiet, with the status of a process killed by SIGPIPE.
EXIT_PIPE = 128 + 13
CLI_OVERWRITE_HINT = "pass --overwrite to replace it"

_DESCRIPTION = """\
Checkpoints that survive failures cheaply: see a training job killed and resumed bit for bit
(demo), measure your storage (bench), choose a checkpoint interval (plan), and verify, inspect,
list, reshard and convert checkpoints.

Exit status: 0 when everything is fine, 1 when a check fails (a corrupt or incomplete
checkpoint, a failed conversion, a resume that was not exact), 2 on a usage error or when there is no checkpoint at all.
Every command takes --json for machine-readable output."""

_EXAMPLES = """\
examples:
  goodput-ckpt demo
  goodput-ckpt bench /mnt/checkpoints --size 4GiB --json > bench.json
  goodput-ckpt plan --from-bench bench.json --restart 5m --mtbf 3h
  goodput-ckpt verify /ckpt/step_00001000
  goodput-ckpt inspect /ckpt/step_00001000 --keys 'model.*'
  goodput-ckpt ls /ckpt --verify
  goodput-ckpt reshard /ckpt/step_00001000 /ckpt/resharded --world-size 8
  goodput-ckpt convert /ckpt/step_00001000 model.safetensors --to safetensors

Run `goodput-ckpt COMMAND --help` for a command's options and examples."""


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)  # numbers, true/false, null, quoted strings
    except ValueError:
        return key, value


def build_parser(commands: Sequence[Command]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="goodput-ckpt",
        description=_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"goodput-ckpt {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print a JSON document instead of text")
    common.add_argument("--no-progress", action="store_true", help="never draw a progress bar")
    common.add_argument("--debug", action="store_true", help="show the traceback of any error")
    store_opts = argparse.ArgumentParser(add_help=False)
    store_opts.add_argument(
        "-o",
        "--option",
        dest="options",
        action="append",
        type=_parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="storage backend option (repeatable), e.g. -o fsync=false",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for cmd in commands:
        epilog = "examples:\n" + "\n".join(f"  {e}" for e in cmd.examples) if cmd.examples else None
        p = sub.add_parser(
            cmd.name,
            help=cmd.summary,
            description=cmd.description,
            epilog=epilog,
            parents=[common] + ([store_opts] if cmd.uses_stores else []),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        cmd.configure(p)
        p.set_defaults(_command=cmd)
    return parser


def main(argv: Sequence[str] | None = None, *, stdout=None, stderr=None) -> int:
    """Run ``goodput-ckpt`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    out_stream, err_stream = stdout or sys.stdout, stderr or sys.stderr
    parser = build_parser(load_commands())
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error (argparse printed it)
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_USAGE
    cmd: Command | None = getattr(args, "_command", None)
    if cmd is None:
        parser.print_help(out_stream)
        return EXIT_USAGE
    if hasattr(args, "options"):
        args.options = dict(args.options)
    out = Output(json_mode=args.json, progress=not args.no_progress, stdout=out_stream, stderr=err_stream)
    try:
        code = cmd.run(args, out)
        out.flush()
        return code
    except StdoutClosed:
        if out_stream is sys.stdout:
            # Python flushes stdout again at exit and would print "Exception ignored ... Broken pipe".
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return EXIT_PIPE
    except KeyboardInterrupt:
        out.warn("interrupted")
        return 130
    except BaseException as e:  # noqa: BLE001 - every error becomes a message and an exit code
        if isinstance(find_interrupt(e), KeyboardInterrupt):  # a Ctrl-C that DCP wrapped
            out.warn("interrupted")
            return 130
        code, kind = _classify(e)
        if code is None:
            raise
        if args.debug:
            traceback.print_exc(file=err_stream)
        if out.json_mode:
            out.emit_json({"ok": False, "exit_code": code, "error": _error_doc(e, kind)})
        message, hint = _message(e, kind), ""
        if kind == "CheckpointExistsError" and hasattr(args, "overwrite"):
            # The library's message speaks to Python callers; a CLI user gets the option instead.
            if OVERWRITE_HINT in message:
                message = message.replace(OVERWRITE_HINT, CLI_OVERWRITE_HINT)
            else:
                hint = f" ({CLI_OVERWRITE_HINT})"
        if not _typed(e, kind) and not args.debug:
            hint += " (run with --debug for the traceback)"
        out.warn(f"goodput-ckpt {cmd.name}: error: {escape(redact(message))}{hint}")
        return code


def _classify(e: BaseException) -> tuple[int | None, str]:
    """The exit code for an error and the kind it is reported as; ``None`` only for what
    must not be swallowed (``SystemExit``, ``GeneratorExit``).

    Why: a hostile or damaged input reaches the CLI in many shapes (MemoryError, RecursionError
    from deep nesting, OverflowError, IndexError, RuntimeError from torch); each is a failed
    command (exit 1) with a message, never a traceback. Exit 2 means the user asked wrongly or
    nothing is there, so a ValueError or TypeError is a usage error only when goodput-ckpt's
    own code raised it on purpose (an argument check, an unknown option); one raised while
    parsing data (by json, struct, torch) is a failure like any other.
    """
    from ..errors import find_checkpoint_error

    inner = find_checkpoint_error(e) if not isinstance(e, CheckpointError) else e
    if isinstance(inner, (CheckpointNotFoundError, CheckpointExistsError)):
        return EXIT_USAGE, type(inner).__name__
    if isinstance(inner, CheckpointError):
        return EXIT_FAILED, type(inner).__name__
    if isinstance(e, (ValueError, TypeError)) and _raised_on_purpose(e):
        return EXIT_USAGE, "UsageError"
    if isinstance(e, (SystemExit, GeneratorExit)):
        return None, ""
    return EXIT_FAILED, type(e).__name__  # also DCP's CheckpointException, a BaseException


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _raised_on_purpose(e: BaseException) -> bool:
    """Whether ``e`` comes from a ``raise`` statement in goodput-ckpt's own code."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    return filename.startswith(_PACKAGE) and linecache.getline(filename, tb.tb_lineno).lstrip().startswith("raise ")


def _typed(e: BaseException, kind: str) -> bool:
    """Whether ``e`` is an error of ours (a checkpoint or usage error), whose message is
    enough on its own: no type prefix, no --debug hint."""
    from ..errors import find_checkpoint_error

    return kind == "UsageError" or isinstance(e, CheckpointError) or find_checkpoint_error(e) is not None


def _message(e: BaseException, kind: str) -> str:
    from ..errors import find_checkpoint_error

    if _typed(e, kind):
        inner = find_checkpoint_error(e) if not isinstance(e, CheckpointError) else e
        return str(inner if inner is not None else e)
    if isinstance(e, MemoryError):
        return "MemoryError: out of memory (an input claims more than this machine holds?)"
    if isinstance(e, RecursionError):
        return f"RecursionError: a value is nested too deeply to process ({e})"
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _error_doc(e: BaseException, kind: str) -> dict[str, Any]:
    doc: dict[str, Any] = {"type": kind, "message": redact(_message(e, kind))}
    if isinstance(e, CheckpointError):
        doc.update(
            path=redact(e.path) if e.path else e.path,
            byte_range=to_jsonable(e.byte_range),
            key=e.key,
            version=to_jsonable(e.version),
        )
    return doc
