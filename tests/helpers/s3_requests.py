"""Counting a process's S3 requests by operation, on the store's real boto3 client.

The store builds its client from the ``session`` option when one is given (``_s3_client``), and
botocore copies a session's event handlers into every client it creates. So a session with a
``before-parameter-build.s3`` handler counts every request of every store that process opens (a
``CheckpointWriter``, a ``CheckpointReader``, each step of a ``CheckpointManager``), per call
attempt: botocore's own retries are off, and the store's retries call again. A proxy in front of
the server (``helpers.s3.FaultProxy``) sees the same requests but cannot tell ranks apart; this
counter lives in the rank's own process.

Used by ``tests/storage/test_s3_requests.py`` and ``benchmarks/bench_requests.py``.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

__all__ = ["RequestCounter", "by_operation"]


class RequestCounter:
    """Counts ``(operation, key or list prefix)`` of the requests made through :meth:`session`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the store's part uploads and reads run on many threads
        self._counts: Counter[tuple[str, str]] = Counter()
        self._session: Any = None

    def session(self) -> Any:
        """A boto3 session whose clients report every request here (pass it as ``session=``)."""
        if self._session is None:
            import boto3

            self._session = boto3.session.Session()
            # API parameters (Key, Prefix) and the operation, once per call attempt.
            self._session.events.register("before-parameter-build.s3", self._count)
        return self._session

    def _count(self, model: Any, params: dict[str, Any], **_: Any) -> None:
        where = params.get("Key", params.get("Prefix", ""))
        with self._lock:
            self._counts[(model.name, str(where))] += 1

    def take(self) -> Counter[tuple[str, str]]:
        """The counts since the last ``take`` (and start again from zero)."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
        return counts


def by_operation(counts: Counter[tuple[str, str]]) -> dict[str, int]:
    """``{operation: requests}``, summed over keys."""
    out: Counter[str] = Counter()
    for (op, _), n in counts.items():
        out[op] += n
    return dict(sorted(out.items()))


# -- the workload: what one rank does, phase by phase -------------------------------------------
#: The phases of :func:`count_rank_requests`, in the order they run.
PHASES = ("dcp.save", "dcp.load", "manager.save", "manager.steady", "manager.restore")


def count_rank_requests(
    rank: int,
    world_size: int,
    endpoint: str,
    root: str,
    shapes: list[tuple[str, tuple[int, ...]]],
    layers: int,
    out: str,
) -> None:
    """One rank of a save and restore against ``root`` (``s3://bucket/prefix``), counting requests.

    Runs under ``helpers.dist.run_ranks`` (the default gloo group is up). Phases (:data:`PHASES`):
    ``dcp.save`` of ``shapes`` as ``Shard(0)`` DTensors over all ranks (FSDP's layout) through
    ``CheckpointWriter``, ``dcp.load`` of them through ``CheckpointReader`` (checked bit-exact), then
    a ``CheckpointManager`` (``keep_last=2``) save of an FSDP2 model of ``layers`` linear layers
    with AdamW (its first save, step 1), its steady-state save of step 4 (after steps 2 and 3;
    it retires step 2), and the restore of step 4 by a new manager (a restarted job: it finds
    the latest step itself). Each phase
    runs between barriers, so its counts hold only its own requests.

    Rank 0 writes ``out`` (JSON): ``{phase: [{operation: requests} of each rank], "keys": ...}``
    where ``keys`` holds every rank's ``[operation, key or prefix, requests]`` per phase.
    """
    import json

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from goodput_ckpt import CheckpointManager, CheckpointReader, CheckpointWriter

    counter = RequestCounter()
    opts = {"endpoint_url": endpoint, "addressing_style": "path", "region": "us-east-1", "session": counter.session()}
    mesh = init_device_mesh("cpu", (world_size,))

    def full(i: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + i

    def state(fill: bool) -> dict[str, Any]:
        return {
            name: distribute_tensor(
                full(i, shape) if fill else torch.zeros(shape), mesh, [Shard(0)], src_data_rank=None
            )
            for i, (name, shape) in enumerate(shapes)
        }

    def model() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Sequential(*(nn.Linear(32, 32) for _ in range(layers)))
        for layer in m:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        m(torch.ones(2, 32)).sum().backward()
        opt.step()  # AdamW's moments exist
        return m, opt

    phases: dict[str, Counter[tuple[str, str]]] = {}

    def phase(name: str, fn: Any) -> Any:
        dist.barrier()
        counter.take()
        result = fn()
        dist.barrier()
        phases[name] = counter.take()
        return result

    sd = state(True)
    phase("dcp.save", lambda: dcp.save(sd, storage_writer=CheckpointWriter(f"{root}/dcp", **opts)))
    target = state(False)
    phase("dcp.load", lambda: dcp.load(target, storage_reader=CheckpointReader(f"{root}/dcp", **opts)))
    for name, t in target.items():
        assert torch.equal(t.to_local(), sd[name].to_local()), f"{name} differs after the load"

    m, opt = model()

    def manager_save() -> CheckpointManager:
        mgr = CheckpointManager(f"{root}/mgr", async_save=False, keep_last=2, **opts)
        mgr.save(1, model=m, optimizer=opt)
        return mgr

    mgr = phase("manager.save", manager_save)
    try:
        mgr.save(2, model=m, optimizer=opt)
        mgr.save(3, model=m, optimizer=opt)  # retires step 1 (reading step 2's record: its first retirement)
        # The steady state: neither the manager's first save nor its first retirement.
        phase("manager.steady", lambda: mgr.save(4, model=m, optimizer=opt))  # retires step 2
    finally:
        mgr.close()
    m2, opt2 = model()
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()

    def manager_restore() -> int | None:
        mgr = CheckpointManager(f"{root}/mgr", async_save=False, **opts)
        try:
            return mgr.restore(model=m2, optimizer=opt2)
        finally:
            mgr.close()

    assert phase("manager.restore", manager_restore) == 4
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), "a parameter differs after the restore"

    mine = {name: [[op, key, n] for (op, key), n in sorted(c.items())] for name, c in phases.items()}
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, mine)
    if rank == 0:
        report: dict[str, Any] = {
            name: [by_operation(Counter({(op, key): n for op, key, n in r[name]})) for r in every] for name in PHASES
        }
        report["keys"] = every
        with open(out, "w") as f:
            json.dump(report, f)
