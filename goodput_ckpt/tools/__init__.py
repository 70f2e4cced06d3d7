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

The modules are grouped by purpose: checkpoint operations (:mod:`.ops`), benchmarks and
measurement (:mod:`.measure`), demos (:mod:`.demos`); :mod:`._common` and ``_formats/`` serve
them all. ``verify``, ``inspect`` and ``ls`` need no torch; the names are imported lazily so that
using them does not load it.
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

_WHERE: dict[str, str] = {
    "verify_checkpoint": ".ops.verify",
    "inspect_checkpoint": ".ops.inspect",
    "list_checkpoints": ".ops.ls",
    "reshard_checkpoint": ".ops.reshard",
    "convert_checkpoint": ".ops.convert",
    "detect_format": ".ops.convert",
    "bench_storage": ".measure.bench",
    "run_demo": ".demos.demo",
    "plan_interval": ".measure.plan",
    "plan_two_levels": ".measure.plan_two_level",
}
#: Exported under another name than the function's own (which is its module's name).
_NAME = {"bench_storage": "bench", "plan_interval": "plan", "plan_two_levels": "plan_two_level"}


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'goodput_ckpt.tools' has no attribute {name!r}")
    return getattr(importlib.import_module(where, __name__), _NAME.get(name, name))
