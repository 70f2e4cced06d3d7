"""Argument helpers shared by the commands that read one location and write another."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_two_store_options", "two_store_options"]


def add_two_store_options(p: argparse.ArgumentParser) -> None:
    from ._main import _parse_option

    p.add_argument(
        "--src-option",
        dest="src_options",
        action="append",
        type=_parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="storage backend option for SRC (repeatable)",
    )
    p.add_argument(
        "--dst-option",
        dest="dst_options",
        action="append",
        type=_parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="storage backend option for DST (repeatable)",
    )


def two_store_options(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The backend options of SRC and DST; refuses a DST that ends with this process.

    Why: ``memory://`` lives in the process's memory. From Python it is a fine scratch
    destination; from the command line the process exits as soon as the command reports
    success, and the result is gone.

    Raises:
        ValueError: DST is a ``memory://`` URL.
    """
    if str(getattr(args, "dst", "")).startswith("memory://"):
        raise ValueError(
            f"{args.dst}: memory:// lives only as long as this command, so the output would vanish when it exits; "
            "write to a path or a persistent URL (use memory:// from Python, where the process keeps it)"
        )
    return dict(args.src_options), dict(args.dst_options)
