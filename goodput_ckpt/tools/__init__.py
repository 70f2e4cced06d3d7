"""The tools behind the ``goodput-ckpt`` command, as library functions.

Each returns a dataclass report that the CLI renders as a table or JSON:

- :func:`verify_checkpoint` (``verify``): manifest, file sizes and every chunk's blake3;
- :func:`inspect_checkpoint` (``inspect``): version, step, world size, sections, item table;
- :func:`list_checkpoints` (``ls``): the checkpoints under a manager root and their status;
- :func:`reshard_checkpoint` (``reshard``): rewrite for M ranks (dim-0 split), streaming;
- :func:`convert_checkpoint` (``convert``): between the goodput format, torch DCP, ``torch.save`` and
  safetensors, streaming;
- :func:`bench_storage` (``bench``): save, load, stall and verify throughput of a storage location,
  against torch's own writers;
- :func:`run_demo` (``demo``): a training job killed, resumed bit for bit, and its goodput;
- :func:`plan_interval` (``plan``): the checkpoint interval that maximizes goodput;
- :func:`plan_two_levels` (``plan --local-stall ... --node-mtbf ... --job-mtbf ...``): the local
  interval and ``persist_every`` of a two-tier manager, against one tier.

``verify``, ``inspect`` and ``ls`` need no torch; the names are imported lazily so that using
them does not load it.
"""

from __future__ import annotations

import importlib

__all__ = [
    "bench_storage",
    "convert_checkpoint",
    "detect_format",
    "inspect_checkpoint",
    "list_checkpoints",
    "plan_interval",
    "plan_two_levels",
    "reshard_checkpoint",
    "run_demo",
    "verify_checkpoint",
]

_WHERE: dict[str, str | tuple[str, str]] = {
    "verify_checkpoint": ".verify",
    "inspect_checkpoint": ".inspect",
    "list_checkpoints": ".ls",
    "reshard_checkpoint": ".reshard",
    "convert_checkpoint": ".convert",
    "detect_format": ".convert",
    "bench_storage": (".bench", "bench"),
    "run_demo": ".demo",
    "plan_interval": (".plan", "plan"),
    "plan_two_levels": (".plan_two_level", "plan_two_level"),
}


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'goodput_ckpt.tools' has no attribute {name!r}")
    # A function named like its module is exported under another name: importing the module
    # sets the package attribute of that name to the module.
    module, attr = where if isinstance(where, tuple) else (where, name)
    return getattr(importlib.import_module(module, __name__), attr)
