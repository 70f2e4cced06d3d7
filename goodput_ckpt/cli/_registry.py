"""The subcommand registry: each command is a :class:`Command` in its own module.

A command module defines ``COMMAND`` and is listed in :data:`COMMAND_MODULES`; nothing else
changes when a command is added (``bench``, ``demo`` and ``plan`` slot in this way). Command
modules must import quickly (no torch at import time): the library is imported inside ``run``,
so ``--help`` and ``--version`` stay instant.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._output import Output

__all__ = ["COMMAND_MODULES", "Command", "load_commands"]

#: Modules of ``goodput_ckpt.cli`` that define a ``COMMAND``, in the order ``--help`` lists them.
COMMAND_MODULES = ("demo", "verify", "inspect", "ls", "reshard", "convert", "bench", "plan")


@dataclass(frozen=True)
class Command:
    """One ``goodput-ckpt`` subcommand.

    Attributes:
        name: the word on the command line.
        summary: one line, shown in the command list.
        description: what it does, shown by ``goodput-ckpt NAME --help``.
        examples: command lines shown under ``Examples`` in ``--help``.
        configure: adds the command's arguments to its parser.
        run: does the work, renders through the :class:`Output`, returns the exit code.
        uses_stores: whether ``-o KEY=VALUE`` backend options apply (single-location commands).
    """

    name: str
    summary: str
    description: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Output], int]
    examples: tuple[str, ...] = field(default_factory=tuple)
    uses_stores: bool = True


def load_commands(modules: tuple[str, ...] = COMMAND_MODULES) -> list[Command]:
    out = []
    for name in modules:
        module = importlib.import_module(f"{__package__}.{name}")
        out.append(module.COMMAND)
    return out
