"""The tools behind the ``goodput-ckpt`` command, as library functions.

Each returns a dataclass report that the CLI renders as a table or JSON:

- :func:`verify_checkpoint` (``verify``): manifest, file sizes and every chunk's blake3;
- :func:`inspect_checkpoint` (``inspect``): version, step, world size, sections, item table;
- :func:`list_checkpoints` (``ls``): the checkpoints under a manager root and their status;
- :func:`reshard_checkpoint` (``reshard``): rewrite for M ranks (dim-0 split), streaming;
- :func:`convert_checkpoint` (``convert``): between format v1, torch DCP, ``torch.save`` and
  safetensors, streaming.

``verify``, ``inspect`` and ``ls`` need no torch; the names are imported lazily so that using
them does not load it.
"""

from __future__ import annotations

import importlib

__all__ = [
    "convert_checkpoint",
    "detect_format",
    "inspect_checkpoint",
    "list_checkpoints",
    "reshard_checkpoint",
    "verify_checkpoint",
]

_WHERE = {
    "verify_checkpoint": ".verify",
    "inspect_checkpoint": ".inspect",
    "list_checkpoints": ".ls",
    "reshard_checkpoint": ".reshard",
    "convert_checkpoint": ".convert",
    "detect_format": ".convert",
}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'goodput_ckpt.tools' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
