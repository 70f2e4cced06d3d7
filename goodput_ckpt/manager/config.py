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
    local_dir: str | None = None
    replicas: int = 0
    persist_every: int = 1
    local_keep_last: int | None = None
    free_space_on_full: bool = False
    incremental: bool | int = False

    def __post_init__(self) -> None:
        for name in (
            "async_save",
            "async_staging",
            "fail_fast",
            "save_rng",
            "allow_topology_change",
            "overwrite",
            "verify",
            "free_space_on_full",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        for name in ("thread_count", "chunk_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or a positive integer, got {v!r}")
        for name in ("keep_last", "local_keep_last"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None (keep all) or a positive integer, got {v!r}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 0:
            raise ValueError(f"replicas must be a non-negative integer, got {self.replicas!r}")
        if isinstance(self.persist_every, bool) or not isinstance(self.persist_every, int) or self.persist_every < 1:
            raise ValueError(f"persist_every must be a positive integer, got {self.persist_every!r}")
        if self.local_dir is None and (self.replicas or self.persist_every != 1 or self.local_keep_last is not None):
            raise ValueError("replicas, persist_every and local_keep_last need local_dir (the node-local tier)")
        if self.local_dir is not None and not isinstance(self.local_dir, str):
            raise TypeError(f"local_dir must be a path, got {type(self.local_dir).__name__}")
        inc = self.incremental
        if not isinstance(inc, bool) and (not isinstance(inc, int) or inc < 1):
            raise ValueError(f"incremental must be a bool or a positive integer (saves per full save), got {inc!r}")
        if inc and self.overwrite:
            raise ValueError(
                "incremental saves cannot be combined with overwrite=True yet: overwriting a step deletes its "
                "files first, and a later kept step may reference them; save to a new step instead"
            )
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
