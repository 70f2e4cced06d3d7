"""Argument helpers shared by the commands that read one location and write another."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_two_store_options", "two_store_options"]


def add_two_store_options(p: argparse.ArgumentParser) -> None:
    from ._main import _parse_option

    p.add_argument("--src-option", dest="src_options", action="append", type=_parse_option, default=[],
                   metavar="KEY=VALUE", help="storage backend option for SRC (repeatable)")  # fmt: skip
    p.add_argument("--dst-option", dest="dst_options", action="append", type=_parse_option, default=[],
                   metavar="KEY=VALUE", help="storage backend option for DST (repeatable)")  # fmt: skip


def two_store_options(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    return dict(args.src_options), dict(args.dst_options)
