"""The ``tiers`` target of ``benchmarks/bench_peers.py``: checkpoint managers side by side.

Our ``CheckpointManager`` (one local root, and two tiers) against nvidia-resiliency-ext's
``LocalCheckpointManager`` and torchtitan's ``CheckpointManager`` on the same model and optimizer;
what each method does and what it is timed on is in ``bench_peers.py``'s docstring.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_peers import _cpu, rotate, stats

try:  # module level: its manager pickles the state-dict object itself
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict as _NvrxBasic
except ImportError as _e:
    _NvrxBasic, NVRX_MISSING = None, f"nvidia-resiliency-ext does not import ({_e}): pip install nvidia-resiliency-ext"
else:
    NVRX_MISSING = None

    class CpuTensorAwareStateDict(_NvrxBasic):
        """``BasicTensorAwareStateDict`` without its CUDA assertion (the one change CPU needs)."""

        def __init__(self, state_dict: dict) -> None:  # the parent asserts is_cuda
            self.state_dict = state_dict
            self._is_hollow = False

        def restore_tensor_device(self, non_blocking: bool = True) -> None:
            return None  # already on the CPU


#: Our methods: the async manager is the row every peer is compared with (``ratios``); the synchronous
#: one is compared with the peers whose save also blocks until the bytes are written (``ratios_sync``).
OURS = ("manager", "manager-sync", "manager-2tier")
SYNCHRONOUS = ("nvrx-local", "nvrx-local+fsync", "titan-sync")
#: What each method's checkpoint files are in the page cache when its restore starts
#: (``--restore-cache``): ``as-left`` by its own save (ours: an async save writes its data files
#: around the page cache, so its restore reads the device, while nvrx's ``torch.save`` and
#: torchtitan's writer leave theirs cached); ``warm``: every file read once first, untimed;
#: ``cold``: every file fsynced and dropped from the page cache first (``POSIX_FADV_DONTNEED``).
CACHE_MODES = ("as-left", "warm", "cold")


def set_cache(where: Path, mode: str) -> None:
    """Put every file under ``where`` in the page cache state ``mode`` asks for (``CACHE_MODES``)."""
    if mode == "as-left":
        return
    for f in sorted(where.rglob("*")):
        if not f.is_file():
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            if mode == "warm":
                while os.read(fd, 16 << 20):
                    pass
            else:
                os.fsync(fd)  # DONTNEED drops clean pages only
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _TitanOptimizers:
    """What torchtitan's manager needs of its ``OptimizersContainer``: a Stateful (the same calls)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.opt, sd)


class _NoSchedulers:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        return None


def run_tiers(
    total: int, repeats: int, scratch: Path, skipped: dict[str, str], restore_cache: str = "as-left"
) -> dict[str, Any]:
    """Every manager once per repeat in a rotating order, in a one-rank gloo group (nvrx's manager
    gathers the checkpoint ids over the default group; torchtitan's async mode makes a gloo group).
    ``restore_cache``: the page cache state every restore starts from (``CACHE_MODES``)."""
    if restore_cache not in CACHE_MODES:
        raise ValueError(f"restore_cache must be one of {CACHE_MODES}, got {restore_cache!r}")
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{scratch / 'pg'}", rank=0, world_size=1)
    try:
        return _run_tiers(total, repeats, scratch, skipped, restore_cache)
    finally:
        if owned:
            dist.destroy_process_group()


def _run_tiers(total: int, repeats: int, scratch: Path, skipped: dict[str, str], cache: str) -> dict[str, Any]:
    from bench_stall import build, state_tensors

    from goodput_ckpt import CheckpointManager

    model, opt, _fb, _step = build(total, 8)
    want = [t.clone() for t in state_tensors(model, opt)]

    def check(label: str) -> None:
        if not all(torch.equal(a, b) for a, b in zip(want, state_tensors(model, opt), strict=True)):
            raise AssertionError(f"{label}: the restored state differs from the saved one")

    def scramble(where: Path) -> None:
        with torch.no_grad():
            for t in state_tensors(model, opt):
                t.zero_()
        set_cache(where, cache)

    def manager(two_tiers: bool, sync: bool = False) -> Callable[[Path], tuple[float, float, float]]:
        def run(where: Path) -> tuple[float, float, float]:
            kw: dict[str, Any] = {"local_dir": str(where / "local")} if two_tiers else {}
            kw.update(async_save=False) if sync else kw.update(async_staging=False)
            root = str(where / "persistent")
            # keep_last=None, as torchtitan's keep_latest_k=0 here: the timed save deletes no
            # step (nvrx's synchronous save unlinks its one older file; ours would wait for a
            # step directory's deletion in `wait`, which its retention thread runs).
            with CheckpointManager(root, keep_last=None, timeline=False, **kw) as mgr:
                mgr.save(0, model=model, optimizer=opt)  # allocates the staging buffers (as in a long job)
                mgr.wait()
                t0 = time.perf_counter()
                mgr.save(1, model=model, optimizer=opt)
                stall = time.perf_counter() - t0
                mgr.wait()
                durable = time.perf_counter() - t0
            scramble(where)
            with CheckpointManager(root, timeline=False, **kw) as mgr:
                t0, c0 = time.perf_counter(), _cpu()
                assert mgr.restore(model=model, optimizer=opt) == 1
                restore = time.perf_counter() - t0
                restore_cpu.append(_cpu() - c0)
            check("manager")
            return stall, durable, restore

        return run

    def titan(mode: str) -> Callable[[Path], tuple[float, float, float]]:
        def run(where: Path) -> tuple[float, float, float]:
            from torchtitan.components.checkpointer.dcp import CheckpointManager as Titan

            cfg = Titan.Config(
                enable=True,
                folder="ckpt",
                interval=1,
                async_mode=mode,
                last_save_model_only=False,
                keep_latest_k=0,
                initial_load_model_only=False,
            )

            def make() -> Any:
                return Titan(
                    cfg,
                    dataloader=None,
                    model_parts=[model],
                    optimizers=_TitanOptimizers(model, opt),
                    lr_schedulers=_NoSchedulers(),
                    states={},
                    sd_adapter=None,
                    base_folder=str(where),
                )

            m = make()
            m.save(1)  # the first save (its async mode's gloo group, staging memory)
            m.maybe_wait_for_staging()
            m.maybe_wait_for_saving()
            t0 = time.perf_counter()
            m.save(2)
            m.maybe_wait_for_staging()
            stall = time.perf_counter() - t0
            m.maybe_wait_for_saving()
            durable = time.perf_counter() - t0
            m.close()
            scramble(where)
            t0, c0 = time.perf_counter(), _cpu()
            m = make()
            assert m.load(2)
            restore = time.perf_counter() - t0
            restore_cpu.append(_cpu() - c0)
            m.close()
            check(f"torchtitan {mode}")
            return stall, durable, restore

        return run

    def nvrx(fsync: bool) -> Callable[[Path], tuple[float, float, float]]:
        def run(where: Path) -> tuple[float, float, float]:
            from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

            tasd = CpuTensorAwareStateDict
            mgr = LocalCheckpointManager(str(where))
            mgr.save(tasd({"model": model.state_dict(), "optim": opt.state_dict()}), 0)
            t0 = time.perf_counter()
            mgr.save(tasd({"model": model.state_dict(), "optim": opt.state_dict()}), 1)
            stall = time.perf_counter() - t0
            if fsync:
                for f in where.rglob("*"):
                    if f.is_file():
                        fd = os.open(f, os.O_RDONLY)
                        os.fsync(fd)
                        os.close(fd)
            durable = time.perf_counter() - t0
            scramble(where)
            t0, c0 = time.perf_counter(), _cpu()
            reader = LocalCheckpointManager(str(where))
            assert reader.find_latest() == 1  # a collective: its load requires it first
            loaded, _id = reader.load()
            model.load_state_dict(loaded.state_dict["model"])
            opt.load_state_dict(loaded.state_dict["optim"])
            restore = time.perf_counter() - t0
            restore_cpu.append(_cpu() - c0)
            check("nvrx-local")
            return stall, durable, restore

        return run

    restore_cpu: list[float] = []  # this process's CPU seconds (every thread) of the last restore
    methods: dict[str, Callable[[Path], tuple[float, float, float]]] = {
        "manager": manager(False),
        "manager-sync": manager(False, sync=True),
        "manager-2tier": manager(True),
    }
    if NVRX_MISSING is None:
        methods["nvrx-local"], methods["nvrx-local+fsync"] = nvrx(False), nvrx(True)
    else:
        skipped["nvrx-local"] = NVRX_MISSING
    skipped["nvrx-local async"] = (
        "its save(is_async=True) calls torch.cuda.synchronize() (no CUDA here) and its "
        "AsyncRequest needs the CUDA path; its replication (a group per node) was not set up either"
    )
    try:
        import torchtitan.components.checkpointer.dcp  # noqa: F401
    except Exception as e:  # it imports much of its trainer
        skipped["torchtitan"] = (
            f"torchtitan's checkpointer does not import ({type(e).__name__}: {e}): pip install torchtitan"
        )
    else:
        methods["titan-sync"], methods["titan-async"] = titan("disabled"), titan("async")
    out: dict[str, dict[str, list[float]]] = {
        m: {"stall": [], "durable": [], "restore": [], "restore_cpu": []} for m in methods
    }
    order = []
    for r in range(repeats):
        rotated = rotate(list(methods), r)
        order.append(rotated)
        for m in rotated:
            where = scratch / f"{m}-{r}"
            stall, durable, restore = methods[m](where)
            shutil.rmtree(where)
            out[m]["stall"].append(stall)
            out[m]["durable"].append(durable)
            out[m]["restore"].append(restore)
            out[m]["restore_cpu"].append(restore_cpu.pop())
    nbytes = sum(t.numel() * t.element_size() for t in want)

    def against(ours: str, peers: list[str]) -> dict[str, Any]:
        return {
            peer: {
                p: stats([t / o for t, o in zip(out[peer][p], out[ours][p])]) for p in ("stall", "durable", "restore")
            }
            for peer in peers
        }

    peers = [m for m in out if m not in OURS]
    return {
        "restore_cache": cache,
        "bytes": nbytes,
        "order": order,
        "seconds": out,
        "ratios": against("manager", peers + ["manager-2tier"]),
        "ratios_sync": against("manager-sync", [m for m in peers if m in SYNCHRONOUS]),
    }
