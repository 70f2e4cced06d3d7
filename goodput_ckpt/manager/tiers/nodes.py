"""Which node a rank is on, where its node-local tier lives, and which nodes hold its replicas.

A rank's node is ``rank // local_world_size``, with ``local_world_size`` from the variable
torchrun sets (``LOCAL_WORLD_SIZE``) unless given. Ranks are laid out node by node, as torchrun
and SLURM do. The replicas of a rank's files go to the rank with the same local rank on each of
the next ``replicas`` nodes (ring order), so every node receives exactly as much as it sends
and a lost node's files survive on its successors. No torch here.
"""

from __future__ import annotations

import os
import string
from dataclasses import dataclass

__all__ = ["NodeLayout", "local_root"]

#: The one placeholder a ``local_dir`` template may hold.
NODE_FIELD = "node"


@dataclass(frozen=True)
class NodeLayout:
    """The node layout of a job, seen from ``rank``.

    Raises:
        ValueError: ``world_size`` is not a whole number of nodes, or there are not enough nodes
            for ``replicas`` copies on other nodes.
    """

    rank: int
    world_size: int
    local_world_size: int
    replicas: int = 0

    def __post_init__(self) -> None:
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ValueError(
                f"the world size {self.world_size} is not a whole number of nodes of {self.local_world_size} "
                "ranks (local_world_size, from LOCAL_WORLD_SIZE)"
            )
        if not 0 <= self.replicas < self.nodes:
            raise ValueError(
                f"replicas={self.replicas} needs at least {self.replicas + 1} nodes to put each copy on "
                f"another node; this job has {self.nodes} (world size {self.world_size}, "
                f"{self.local_world_size} ranks per node)"
            )

    @classmethod
    def of(cls, rank: int, world_size: int, *, local_world_size: int | None, replicas: int) -> NodeLayout:
        """The layout from ``local_world_size`` or, when ``None``, ``LOCAL_WORLD_SIZE`` (default:
        the whole job on one node).

        Raises:
            ValueError: a bad ``LOCAL_WORLD_SIZE`` or layout (see the class).
        """
        if local_world_size is None:
            raw = os.environ.get("LOCAL_WORLD_SIZE")
            try:
                local_world_size = int(raw) if raw else world_size
            except ValueError:
                raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {raw!r}") from None
        return cls(rank, world_size, local_world_size, replicas)

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def ranks_of(self, node: int) -> range:
        """The ranks on ``node``."""
        return range(node * self.local_world_size, (node + 1) * self.local_world_size)

    def replica_holders(self, rank: int) -> list[int]:
        """The ranks that keep copies of ``rank``'s files, one per next node (ring order)."""
        return [(rank + i * self.local_world_size) % self.world_size for i in range(1, self.replicas + 1)]


def local_root(template: str, node: int) -> str:
    """``template`` with ``{node}`` replaced by ``node`` (only that placeholder is allowed, so a
    stray brace is an error here, not a directory named after it).

    Raises:
        ValueError: another placeholder, or a malformed one.
    """
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(f"local_dir {template!r} is not a valid template: {e}") from None
    bad = [f for f in fields if f != NODE_FIELD]
    if bad:
        raise ValueError(f"local_dir {template!r} may hold only {{{NODE_FIELD}}}, not {{{bad[0]}}}")
    return template.format(node=node)
