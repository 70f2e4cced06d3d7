"""Which node a rank is on, where its node-local tier lives, and which nodes hold its replicas.

A rank's node is ``rank // local_world_size``, with ``local_world_size`` from the variable
torchrun sets (``LOCAL_WORLD_SIZE``) unless given. Ranks are laid out node by node, as torchrun
and SLURM do. The replicas of a rank's files go to the rank with the same local rank on each of
the next ``replicas`` nodes (ring order), so every node receives exactly as much as it sends
and a lost node's files survive on its successors. No torch here.
"""

from __future__ import annotations

import glob
import os
import re
import string
from dataclasses import dataclass

__all__ = ["NodeLayout", "local_root", "node_dirs"]

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


#: The most node directories :func:`node_dirs` returns (a glob of a hostile template is bounded).
MAX_NODE_DIRS = 65536


def node_dirs(template: str) -> dict[int, str]:
    """The existing local directories of ``template``, by node (the template itself as node 0
    when it holds no ``{node}``); for ``goodput-ckpt ls`` and other readers of every node.

    Raises:
        ValueError: a malformed template (see :func:`local_root`), or more than
            :data:`MAX_NODE_DIRS` matches.
    """
    local_root(template, 0)  # validates
    if "{" + NODE_FIELD + "}" not in template:
        return {0: template} if os.path.isdir(template) else {}
    head, _, tail = template.partition("{" + NODE_FIELD + "}")
    pattern = re.compile(
        re.escape(head) + r"(\d+)" + re.escape(tail).replace(re.escape("{" + NODE_FIELD + "}"), r"\1") + r"\Z"
    )
    found: dict[int, str] = {}
    for path in glob.iglob(
        glob.escape(head) + "*" + glob.escape(tail).replace(glob.escape("{" + NODE_FIELD + "}"), "*")
    ):
        m = pattern.match(path)
        if m is not None and os.path.isdir(path) and local_root(template, int(m.group(1))) == path:
            found[int(m.group(1))] = path
            if len(found) > MAX_NODE_DIRS:
                raise ValueError(f"more than {MAX_NODE_DIRS} node directories match {template!r}")
    return dict(sorted(found.items()))
