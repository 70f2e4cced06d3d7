"""goodput-ckpt: fast, verifiable, resumable PyTorch checkpoints.

Public API (listed in the README's "Public API" section, which a test compares with
``__all__``): :class:`CheckpointWriter` and
:class:`CheckpointReader` are ``torch.distributed.checkpoint`` storage plugins and
:class:`GridLoadPlanner` its load planner for large world sizes;
:class:`CheckpointManager` saves and resumes the whole training state; the errors form one
hierarchy under :class:`CheckpointError`.
"""

from ._version import __version__
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    TopologyChangeError,
)

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointWriter",
    "CorruptCheckpointError",
    "GridLoadPlanner",
    "IncompleteCheckpointError",
    "TopologyChangeError",
    "__version__",
]


def __getattr__(name: str):
    # The DCP adapters import torch; keep ``import goodput_ckpt`` (and the storage layer) light.
    if name == "CheckpointWriter":
        from .dcp.writer import CheckpointWriter

        return CheckpointWriter
    if name == "CheckpointManager":
        from .manager.checkpoint_manager import CheckpointManager

        return CheckpointManager
    if name == "GridLoadPlanner":
        from .dcp.load_planner import GridLoadPlanner

        return GridLoadPlanner
    if name == "CheckpointReader":
        from .dcp.reader import CheckpointReader

        return CheckpointReader
    raise AttributeError(f"module 'goodput_ckpt' has no attribute {name!r}")
