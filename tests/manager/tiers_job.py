"""Rank functions of the two-tier tests (test_tiers.py), run on real gloo processes by
``helpers.dist.run_ranks``: a small model and optimizer saved and restored through a two-tier
``CheckpointManager`` on simulated nodes (``LOCAL_WORLD_SIZE`` ranks share one ``{node}``
directory)."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from goodput_ckpt import CheckpointManager
from goodput_ckpt.errors import CheckpointError


def make(rank: int, width: int = 64, freeze_first: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer; ``freeze_first``: the first layer frozen (what an incremental
    save references: the SIGKILL tests' ``"freeze_first"`` option)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))
    if freeze_first:
        model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """One step, the same on every rank (the model is replicated: DCP keeps one rank's copy)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, model[0].in_features, generator=g)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """sha256 of every parameter and optimizer state tensor's bytes (bit for bit, unlike a sum,
    whose rounding depends on the thread count)."""

    def h(t: Any) -> str:
        return hashlib.sha256(torch.as_tensor(t).detach().contiguous().numpy().tobytes()).hexdigest()

    out = {f"p.{k}": h(v) for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"o.{i}.{k}"] = h(v)
    return out


def save_steps(rank: int, world: int, root: str, local: str, steps: int, opts: dict[str, Any], out: str) -> None:
    """Train ``steps`` steps, saving each through a two-tier manager; write the final digest."""
    model, opt = make(rank)
    with CheckpointManager(root, local_dir=local, local_world_size=2, **opts) as mgr:
        for step in range(steps):
            train(model, opt, step)
            mgr.save(step, model=model, optimizer=opt)
        mgr.wait()
        Path(out, f"tiers-rank{rank}.json").write_text(json.dumps(mgr.step_tiers()))
    Path(out, f"digest-rank{rank}.json").write_text(json.dumps(digest(model, opt)))


#: The collectives the package and DCP call through ``torch.distributed`` (object and barrier).
_COLLECTIVES = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "barrier",
    "all_gather",
    "broadcast",
    "all_reduce",
    "all_to_all",
)


@contextlib.contextmanager
def _counting_collectives():
    """Count the calls of each ``torch.distributed`` collective made while inside (the public
    functions, patched on the module: each call a rank makes, not the ones they make inside)."""
    counts: collections.Counter[str] = collections.Counter()
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}
    depth = [0]

    def counted(name, fn):
        def call(*args, **kwargs):
            if depth[0] == 0:
                counts[name] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    for name, fn in saved.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _fail_with(exc: BaseException):
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return fail


#: Faults one rank can be given (``restore_step(fault=(rank, name))``): what a disk or a library
#: can raise that is not a ``CheckpointError``, at a step that rank takes alone.
FAULTS = {
    "inventory": ("goodput_ckpt.manager.tiers.candidates", "_inventory", OSError(5, "Input/output error")),
    "reader": ("goodput_ckpt.manager.restoring", "CheckpointReader", RuntimeError("reader exploded")),
}


def restore_step(
    rank: int,
    world: int,
    root: str,
    local: str,
    opts: dict[str, Any],
    out: str,
    width: int = 64,
    fault: tuple[int, str] | None = None,
) -> None:
    """Restore the newest step a two-tier manager can rebuild; write it, its digest and the
    restore's timeline record. ``fault``: ``(rank, name)``, that rank raises one of
    :data:`FAULTS` (patched in its own process)."""
    if fault is not None and fault[0] == rank:
        import importlib

        module, attr, exc = FAULTS[fault[1]]
        setattr(importlib.import_module(module), attr, _fail_with(exc))
    opts = dict(opts)
    model, opt = make(rank, width, opts.pop("freeze_first", False))
    torch.manual_seed(123 + rank)  # restore must overwrite whatever this leaves
    error = None
    logged = _LogKeeper()
    logging.getLogger("goodput_ckpt").addHandler(logged)
    with (
        warnings.catch_warnings(record=True) as caught,
        CheckpointManager(root, local_dir=local, local_world_size=2, **opts) as mgr,
    ):
        warnings.simplefilter("always")
        try:
            with _counting_collectives() as collectives:
                step = mgr.restore(model=model, optimizer=opt)
        except CheckpointError as e:
            step, error = None, str(e)
        record = [r for r in mgr.timeline if r["event"] == "restore"]
    dist.barrier()
    Path(out, f"restored-rank{rank}.json").write_text(
        json.dumps(
            {
                "step": step,
                "error": error,
                "digest": digest(model, opt),
                "record": record[-1] if record else None,
                # the restore's reports: WARNING records of the goodput_ckpt loggers, and no UserWarning
                "warnings": [m for m in logged.messages if "restore of step" in m or "local tier" in m],
                "user_warnings": [
                    str(w.message)
                    for w in caught
                    if "restore of step" in str(w.message) or "local tier" in str(w.message)
                ],
                "collectives": dict(collectives),
                "torch_warnings": [str(w.message) for w in caught if "torch.distributed is disabled" in str(w.message)],
            }
        )
    )


def restore_each(rank: int, world: int, cases: list[tuple]) -> None:
    """``restore_step(rank, world, *case)`` for every case, in this one process group (a group of 4
    ranks costs 10-30 s to start on 2 cores). A case's fault is undone before the next case."""
    import importlib

    for case in cases:
        patched = [(importlib.import_module(m), attr) for m, attr, _ in FAULTS.values()]
        originals = [getattr(module, attr) for module, attr in patched]
        try:
            restore_step(rank, world, *case)
        finally:
            for (module, attr), original in zip(patched, originals):
                setattr(module, attr, original)


class _LogKeeper(logging.Handler):
    """Keeps the messages of the WARNING records it is given."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def reference_digest(steps: int, width: int = 64, freeze_first: bool = False) -> dict[str, str]:
    """The digest after training steps ``0 .. steps-1`` in this process (what a restore of the
    checkpoint saved after step ``steps-1`` must reproduce). One intra-op thread, as the job's
    ranks train (``main``): with two, float reductions may round differently, and the digest then
    depended on whether an earlier test in the same process had left torch at one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, opt = make(0, width, freeze_first)
        for step in range(steps):
            train(model, opt, step)
        return digest(model, opt)
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str]) -> None:
    """One rank of a job that trains and saves every step until it is killed, printing
    ``SAVED step`` (flushed) after each save returns: ``tiers_job.py RANK WORLD PORT ROOT LOCAL
    WIDTH OPTIONS_JSON`` (the SIGKILL tests of test_tiers_sigkill.py)."""
    rank, world, port, root, local, width, opts = (
        int(argv[0]),
        int(argv[1]),
        argv[2],
        argv[3],
        argv[4],
        int(argv[5]),
        json.loads(argv[6]),
    )
    resume = opts.pop("resume", False)  # restore first and go on from the restored step
    freeze_first = opts.pop("freeze_first", False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, opt = make(rank, width, freeze_first)
    with CheckpointManager(root, local_dir=local, local_world_size=2, **opts) as mgr:
        restored = mgr.restore(model=model, optimizer=opt) if resume else None
        print("RESTORED", restored, flush=True)
        for step in range(0 if restored is None else restored + 1, 10_000):
            train(model, opt, step)
            mgr.save(step, model=model, optimizer=opt)
            print("SAVED", step, flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
