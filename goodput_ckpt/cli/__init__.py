"""The ``goodput-ckpt`` command line: a thin layer over :mod:`goodput_ckpt.tools`.

Each subcommand lives in its own module and registers a :class:`~._registry.Command`; this
package parses arguments, calls the tool, and renders its report as text or ``--json``.
"""

from ._main import EXIT_FAILED, EXIT_OK, EXIT_PIPE, EXIT_USAGE, main

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_PIPE", "EXIT_USAGE", "main"]
