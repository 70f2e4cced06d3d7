"""The options of :class:`~goodput_ckpt.CheckpointManager`, checked once when it is created."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ManagerConfig"]


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """The options of a :class:`CheckpointManager` (see its docstring), checked once.

    Raises:
        ValueError / TypeError: an out-of-range value or a value of the wrong type.
    """

    keep_last: int | None = 3
    async_save: bool = True
    async_staging: bool = True
    fail_fast: bool = False
    save_rng: bool = True
    allow_topology_change: bool = False
    overwrite: bool = False
    thread_count: int | None = None
    chunk_size: int | None = None
    verify: bool = True
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.keep_last is not None and (
            isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1
        ):
            raise ValueError(f"keep_last must be None (keep all) or a positive integer, got {self.keep_last!r}")
        for name in ("async_save", "async_staging", "fail_fast", "save_rng", "allow_topology_change", "overwrite", "verify"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        for name in ("thread_count", "chunk_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or a positive integer, got {v!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
