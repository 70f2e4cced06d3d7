"""Two-tier checkpoints (issue 18): restore from the local tier, from a replica and from the
persistent tier on S3, side by side on the same state; and what each tier costs per save.

One run starts one SeaweedFS server (``weed server -s3`` on 127.0.0.1, the recipe of
``tests/helpers/s3.py``) and 4 real gloo ranks laid out as 2 simulated nodes
(``local_world_size=2``, ``local_dir=.../node{node}``), holding a stack of ``Linear`` layers and its AdamW state
(``--size`` in all): sharded by FSDP2 (a quarter per rank, the default) or ``--state replicated``
(the whole state on every rank, the layout of ``tests/manager/test_tiers.py``). Per repeat:

1. *Saves.* A two-tier ``CheckpointManager(s3://bench/tiersN, local_dir=..., replicas=1,
   persist_every=2, keep_last=2)`` saves ``--saves`` steps (an optimizer step between saves);
   every 2nd save, the last one included, is persisted in the background. Then a one-tier
   manager on S3 (``s3://bench/oneN``, today's path) saves the same final state twice.
2. *Restores*, each into a fresh model and optimizer by a fresh manager, of the last step, in a
   rotating order, each followed by a bit-for-bit check against the state that was saved:
   ``local`` (both nodes' local directories intact), ``replica`` (node 1's directory deleted:
   its ranks' files come from their replicas on node 0, over the group), ``persistent`` (both
   local directories deleted: every file is loaded straight from S3, each chunk checked as it
   is read), and ``s3-one-tier`` (the one-tier manager's restore, also read straight from S3:
   the difference is the two-tier restore's own inventory and agreement); ``local-noverify`` is ``local`` with ``verify=False`` (no
   hash checked before or during the load: what the checks cost). ``bytes-local`` and
   ``bytes-s3`` are not restores: each rank reads its own data file of the step into a
   buffer, from its node's local copy or from S3 (ranged GETs on 8 threads), and nothing
   else; their ratio is the most a local restore can gain over an S3 one on this machine from
   the bytes alone. Before each restore the local directories are reset to the state the
   saves left (hard links: the local store never writes a file in place).

Rules:
- A restore's time is the timeline's ``seconds`` of its slowest rank (agreement, checks,
  fetches and the load: the job resumes when every rank has); the sources per tier are the
  timeline's counts, summed over ranks, and checked against what each scenario must use.
- Save costs come from the same timeline, per save the slowest rank: ``stall_s`` (what the
  training loop waited), ``write_s`` (the local write), ``replicate_s``, ``durable_s`` (the save
  thread's whole work for that save: write, manifest to every node, replicas, hand-off to the
  persister, which may wait for the previous persist) and, per persisted step, the persist's
  ``seconds``. The first save of each manager, which allocates the staging buffers, is left
  out of the save figures.
- Ratios are per repeat (restores of one repeat run seconds apart), then median and min-max.
- Busy: the load average at start and end, and during each restore the CPUs used by the whole
  machine, by this benchmark's processes (ranks and server) and by others (the difference).
  Before each restore rank 0 waits up to ``--quiet`` seconds for the machine to calm down.

Run: ``.venv/bin/python benchmarks/bench_tiers.py --size 128MiB --repeats 3 --json tiers.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the SeaweedFS recipe, run_ranks
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_local import _busy_seconds, wait_quiet  # noqa: E402
from helpers.dist import run_ranks  # noqa: E402
from helpers.s3 import SeaweedServer, s3_env  # noqa: E402

from goodput_ckpt import CheckpointManager  # noqa: E402
from goodput_ckpt.cli._output import parse_size  # noqa: E402
from goodput_ckpt.tools.measure._bench_measure import spread_of  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)

MiB = 1 << 20
WORLD, LOCAL_WORLD = 4, 2
METHODS = ("local", "replica", "persistent", "s3-one-tier", "local-noverify", "bytes-local", "bytes-s3")
#: Not restores: each rank only reads its own data file of the restored step, from the local
#: tier or from S3, with nothing else (the limit any restore from that tier has here).
BYTES_ONLY = ("bytes-local", "bytes-s3")
BASELINE = "persistent"
BUCKET = "bench"
_TICK = os.sysconf("SC_CLK_TCK")


# -- the job on each rank ----------------------------------------------------------------------------
def _width(total: int) -> int:
    return 1024 if total >= 64 * MiB else 256


def _make(cfg: dict[str, Any], seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its AdamW, without state yet: ``fsdp2``, each ``Linear`` sharded over the 4
    ranks (its own FSDP group); ``replicated``, the same whole model on every rank (DCP saves
    each tensor from one rank, spread over the ranks' files, and every rank reads all of them)."""
    w = _width(cfg["size"])
    layers = max(1, round(cfg["size"] / (w * w * 12)))  # fp32 weight + exp_avg + exp_avg_sq
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(w, w, bias=False) for _ in range(layers)))
    if cfg["state"] == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """One optimizer step with synthetic gradients, the same on every rank (no forward: only
    the state matters here)."""
    for p in model.parameters():
        p.grad = p.detach() * (1e-2 * (step + 1))
    opt.step()
    opt.zero_grad()


def _local(v: Any) -> torch.Tensor:
    return v.to_local() if hasattr(v, "to_local") else torch.as_tensor(v)


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's part of every parameter and optimizer tensor (copies)."""
    out = []
    for p in model.parameters():
        out.append(_local(p.detach()).clone())
        st = opt.state.get(p, {})
        out.extend(_local(st[k]).clone() for k in ("exp_avg", "exp_avg_sq", "step") if k in st)
    return out


def _pid_cpu(pids: list[int]) -> float:
    """User+system CPU seconds of the processes ``pids`` (all their threads), from /proc."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICK
        except (OSError, IndexError, ValueError):
            pass
    return total


def _reset_local(base: Path, method: str) -> None:
    """Rank 0: the local tier as the saves left it, minus what ``method`` loses."""
    local = base / "local"
    shutil.rmtree(local, ignore_errors=True)
    if method == "persistent":
        return  # both nodes lost
    shutil.copytree(base / "pristine", local, copy_function=os.link)
    if method == "replica":
        shutil.rmtree(local / "node1")


def _save_phase(cfg: dict[str, Any], rep: int, model, opt, opts: dict[str, Any]) -> tuple[list, list, int]:
    base = Path(cfg["base"], f"rep{rep}")
    local = str(base / "local" / "node{node}")
    with CheckpointManager(
        f"s3://{BUCKET}/tiers{rep}",
        local_dir=local,
        local_world_size=LOCAL_WORLD,
        replicas=1,
        persist_every=cfg["persist_every"],
        keep_last=2,
        timeline=False,
        **opts,
    ) as mgr:
        for step in range(cfg["saves"]):
            _step(model, opt, step)
            mgr.save(step, model=model, optimizer=opt)
            time.sleep(cfg["interval"])  # the training between two saves
        mgr.wait()
        two = list(mgr.timeline)
    last = cfg["saves"] - 1
    with CheckpointManager(f"s3://{BUCKET}/one{rep}", keep_last=2, timeline=False, **opts) as mgr:
        for step in (last, last + 1):  # the same state twice: the first one allocates the buffers
            mgr.save(step, model=model, optimizer=opt)
            time.sleep(cfg["interval"])
        mgr.wait()
        one = list(mgr.timeline)
    return two, one, last


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """Every repeat: the saves, then the restores (module doc); rank 0 writes ``results.json``."""
    torch.set_num_threads(1)
    opts = cfg["s3_options"]
    pids = [p for p in _gather(os.getpid()) if p is not None] + [cfg["server_pid"]]
    model, opt = _make(cfg, seed=0)
    reps: list[dict[str, Any]] = []
    for rep in range(cfg["repeats"]):
        base = Path(cfg["base"], f"rep{rep}")
        two, one, last = _save_phase(cfg, rep, model, opt, opts)
        want = _snapshot(model, opt)
        gc.collect()  # the save phase's garbage, too, is not the first restore's to free
        if rank == 0:
            shutil.copytree(base / "local", base / "pristine", copy_function=os.link)
        k = rep % len(cfg["methods"])
        order = cfg["methods"][k:] + cfg["methods"][:k]
        restores: dict[str, Any] = {}
        for method in order:
            quiet_s = 0.0
            if rank == 0:
                _reset_local(base, method)
                quiet_s = wait_quiet(cfg["quiet"])
            dist.barrier()
            if method in BYTES_ONLY:
                restores[method] = _bytes_only(method, cfg, rep, last, rank, pids, quiet_s)
                continue
            fresh, fresh_opt = _make(cfg, seed=1000 + rep)
            if method == "s3-one-tier":
                mgr = CheckpointManager(f"s3://{BUCKET}/one{rep}", keep_last=2, timeline=False, **opts)
                step = last + 1
            else:
                mgr = CheckpointManager(
                    f"s3://{BUCKET}/tiers{rep}",
                    local_dir=str(base / "local" / "node{node}"),
                    local_world_size=LOCAL_WORLD,
                    replicas=1,
                    persist_every=cfg["persist_every"],
                    keep_last=2,
                    timeline=False,
                    verify=method != "local-noverify",
                    **opts,
                )
                step = last
            dist.barrier()
            busy0, ours0, t0 = _busy_seconds(), _pid_cpu(pids), time.perf_counter()
            got = mgr.restore(step, model=fresh, optimizer=fresh_opt)
            dist.barrier()
            wall = time.perf_counter() - t0
            busy, ours = (_busy_seconds() - busy0) / wall, (_pid_cpu(pids) - ours0) / wall
            record = [r for r in mgr.timeline if r["event"] == "restore"][-1]
            mgr.close()
            have = _snapshot(fresh, fresh_opt)
            same = got == step and len(have) == len(want) and all(torch.equal(a, b) for a, b in zip(want, have))
            per_rank = _gather({"seconds": record["seconds"], "sources": record.get("sources"), "same": same})
            restores[method] = {
                "seconds": max(r["seconds"] for r in per_rank),
                "wall_s": wall,
                "rank_seconds": [r["seconds"] for r in per_rank],
                "sources": [r["sources"] for r in per_rank],
                "same": all(r["same"] for r in per_rank),
                "machine_cpus": busy,
                "our_cpus": ours,
                "other_cpus": max(0.0, busy - ours),
                "quiet_wait_s": quiet_s,
                "bytes": record["bytes"],
            }
            del fresh, fresh_opt
            # FSDP modules hold reference cycles: without this, the garbage collector frees the
            # previous restore's model and optimizer (0.3-0.4 s here) in the middle of the next
            # timed restore, on one rank or another. A restarted job has no such garbage.
            gc.collect()
        saves = {"two_tier": _gather(two), "one_tier": _gather(one)}
        if rank == 0:
            reps.append({"order": order, "step": last, "restores": restores, "timeline": saves})
            shutil.rmtree(base, ignore_errors=True)
        dist.barrier()
    if rank == 0:
        Path(cfg["base"], "results.json").write_text(json.dumps(reps))


def _bytes_only(
    method: str, cfg: dict[str, Any], rep: int, step: int, rank: int, pids: list[int], quiet_s: float
) -> dict[str, Any]:
    """Every rank reads its own data file of ``step`` into a buffer, from its node's local copy
    (``bytes-local``: one sequential ``readinto``) or from S3 (``bytes-s3``: 8 MiB ranged GETs on
    8 threads, boto3 with no checksums): the bytes of a restore and nothing else, no hashing,
    no planning, no collective. The time of the slowest rank, as for a restore."""
    import boto3
    from botocore.config import Config

    from goodput_ckpt.manager.step_layout import step_dir_name

    node_dir = Path(cfg["base"], f"rep{rep}", "local", f"node{rank // LOCAL_WORLD}")
    (path,) = node_dir.glob(f"job-*/{step_dir_name(step)}/rank{rank:05d}-*.bin")  # the job's own directory
    size = path.stat().st_size
    buf = bytearray(size)
    view = memoryview(buf)
    client = None
    if method == "bytes-s3":
        client = boto3.client(
            "s3",
            endpoint_url=cfg["s3_options"]["endpoint_url"],
            region_name="us-east-1",
            config=Config(
                s3={"addressing_style": "path"},
                max_pool_connections=16,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
    key = f"tiers{rep}/{step_dir_name(step)}/{path.name}"
    part = 8 * MiB

    def get(o: int) -> None:
        body = client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={o}-{min(size, o + part) - 1}")["Body"]
        at = o
        for chunk in body.iter_chunks(1 << 20):
            view[at : at + len(chunk)] = chunk
            at += len(chunk)
        if at != min(size, o + part):
            raise SystemExit(f"bytes-s3: {key} range at {o} ended early")

    dist.barrier()
    busy0, ours0, t0 = _busy_seconds(), _pid_cpu(pids), time.perf_counter()
    if client is None:
        with open(path, "rb", buffering=0) as f:
            if f.readinto(view) != size:
                raise SystemExit(f"bytes-local: {path} ended early")
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(get, range(0, size, part)))
    seconds = time.perf_counter() - t0
    dist.barrier()
    wall = time.perf_counter() - t0
    busy, ours = (_busy_seconds() - busy0) / wall, (_pid_cpu(pids) - ours0) / wall
    same = buf == path.read_bytes()  # untimed: what arrived is the file
    per_rank = _gather({"seconds": seconds, "same": same, "bytes": size})
    return {
        "seconds": max(r["seconds"] for r in per_rank),
        "wall_s": wall,
        "rank_seconds": [r["seconds"] for r in per_rank],
        "sources": [None] * len(per_rank),
        "same": all(r["same"] for r in per_rank),
        "machine_cpus": busy,
        "our_cpus": ours,
        "other_cpus": max(0.0, busy - ours),
        "quiet_wait_s": quiet_s,
        "bytes": sum(r["bytes"] for r in per_rank),
    }


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# -- the parent: server, ranks, summary ------------------------------------------------------------
def _stats(xs: list[float]) -> dict[str, Any]:
    return spread_of(xs) if xs else {}


def _per_step(per_rank: list[list[dict]], event: str, skip_first: bool) -> dict[int, dict[str, float]]:
    """Step -> field -> the slowest rank's value, for one manager's records of ``event``."""
    steps: dict[int, dict[str, float]] = {}
    for records in per_rank:
        for r in records:
            if r["event"] != event:
                continue
            if not r.get("ok", True):
                raise SystemExit(f"{event} of step {r['step']} failed on rank {r['rank']}: {r['error']}")
            row = steps.setdefault(r["step"], {})
            for k in ("stall_s", "wait_s", "write_s", "replicate_s", "durable_s", "seconds"):
                if r.get(k) is not None:
                    row[k] = max(row.get(k, 0.0), float(r[k]))
            row["bytes"] = row.get("bytes", 0) + r["bytes"]
    if skip_first and steps:
        del steps[min(steps)]
    return steps


def _check_sources(method: str, sources: list[dict[str, int]]) -> None:
    """Each scenario read from the tiers it must (else the figures would measure something else)."""
    tiers = [set(s or {}) for s in sources]
    ok = {
        "local": all(t == {"local"} for t in tiers),
        "local-noverify": all(t == {"local"} for t in tiers),
        "replica": all(t == {"local"} for t in tiers[:LOCAL_WORLD])
        and all("replica" in t and "persistent" not in t for t in tiers[LOCAL_WORLD:]),
        "persistent": all(t == {"persistent"} for t in tiers),
        "s3-one-tier": all(not t for t in tiers),
        "bytes-local": True,
        "bytes-s3": True,
    }[method]
    if not ok:
        raise SystemExit(f"{method}: the restore read from {sources}, not from the tiers this scenario tests")


def summarize(reps: list[dict[str, Any]], args: argparse.Namespace, nbytes: int) -> dict[str, Any]:
    restores: dict[str, dict[str, Any]] = {}
    for m in args.methods:
        for rep in reps:
            r = rep["restores"][m]
            if not r["same"]:
                raise SystemExit(f"{m}: the restored state differs from the saved one")
            _check_sources(m, r["sources"])
        seconds = [rep["restores"][m]["seconds"] for rep in reps]
        restores[m] = {
            "seconds": _stats(seconds),
            "mib_s": nbytes / MiB / statistics.median(seconds),
            "sources": reps[0]["restores"][m]["sources"],
            "other_cpus": _stats([rep["restores"][m]["other_cpus"] for rep in reps]),
            "our_cpus": _stats([rep["restores"][m]["our_cpus"] for rep in reps]),
        }
    speedup = {}
    if BASELINE in args.methods:
        for m in args.methods:
            speedup[m] = _stats([rep["restores"][BASELINE]["seconds"] / rep["restores"][m]["seconds"] for rep in reps])
    # The limit of this machine: how much faster the bytes alone come from the local tier than
    # from S3, per repeat (no restore can beat it by more than its own fixed costs allow).
    limit = {}
    if set(BYTES_ONLY) <= set(args.methods):
        limit = _stats(
            [rep["restores"]["bytes-s3"]["seconds"] / rep["restores"]["bytes-local"]["seconds"] for rep in reps]
        )
    local_saves, persists, one_saves = [], [], []
    for rep in reps:
        two = rep["timeline"]["two_tier"]
        local_saves += list(_per_step(two, "save", skip_first=True).values())
        persists += list(_per_step(two, "persist", skip_first=False).values())
        one_saves += list(_per_step(rep["timeline"]["one_tier"], "save", skip_first=True).values())
    saves = {
        "local": {
            k: _stats([s[k] for s in local_saves]) for k in ("stall_s", "wait_s", "write_s", "replicate_s", "durable_s")
        },
        "persist": {
            "seconds": _stats([p["seconds"] for p in persists]),
            "bytes": persists[0]["bytes"] if persists else 0,
        },
        "s3-one-tier": {k: _stats([s[k] for s in one_saves]) for k in ("stall_s", "wait_s", "write_s", "durable_s")},
    }
    return {
        "payload_bytes": nbytes,
        "state": args.state,
        "world_size": WORLD,
        "nodes": WORLD // LOCAL_WORLD,
        "repeats": args.repeats,
        "saves_per_repeat": args.saves,
        "persist_every": args.persist_every,
        "interval_s": args.interval,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "restore": restores,
        "restore_speedup_vs_persistent": speedup,
        "bytes_s3_vs_local": limit,
        "save": saves,
        "order": [rep["order"] for rep in reps],
        "restored_step": reps[0]["step"] if reps else None,
        "busy": [
            {
                m: {k: rep["restores"][m][k] for k in ("machine_cpus", "our_cpus", "other_cpus", "quiet_wait_s")}
                for m in rep["order"]
            }
            for rep in reps
        ],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, run the ranks, stop it, summarize (the environment is left as found)."""
    environ = dict(os.environ)
    try:
        return _run(args)
    finally:
        os.environ.clear()
        os.environ.update(environ)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.update(s3_env())
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        os.environ.pop(k, None)
    size = parse_size(args.size)
    w = _width(size)
    nbytes = max(1, round(size / (w * w * 12))) * w * w * 12  # what _make builds
    scratch = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=args.dir))
    server = SeaweedServer(scratch / "weed")
    load0 = os.getloadavg()
    try:
        import boto3
        from botocore.config import Config

        boto3.client(
            "s3", endpoint_url=server.url, region_name="us-east-1", config=Config(s3={"addressing_style": "path"})
        ).create_bucket(Bucket=BUCKET)
        cfg = {
            "size": size,
            "repeats": args.repeats,
            "saves": args.saves,
            "persist_every": args.persist_every,
            "methods": list(args.methods),
            "quiet": args.quiet,
            "state": args.state,
            "interval": args.interval,
            "base": str(scratch / "ranks"),
            "server_pid": server.proc.pid,
            "s3_options": {"endpoint_url": server.url, "addressing_style": "path", "region": "us-east-1"},
        }
        Path(cfg["base"]).mkdir()
        # The two-tier restore opens the persistent step without the manager's storage options
        # (goodput_ckpt/manager/tiers/mend.py, store_of): boto3's own variable points it here.
        os.environ["AWS_ENDPOINT_URL_S3"] = server.url
        t0 = time.perf_counter()
        run_ranks(rank_main, WORLD, cfg, report_dir=scratch / "report", timeout=args.timeout)
        reps = json.loads(Path(cfg["base"], "results.json").read_text())
        elapsed = time.perf_counter() - t0
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    report = summarize(reps, args, nbytes)
    report["loadavg"] = {"start": load0, "end": os.getloadavg()}
    report["seconds"] = elapsed
    report["repeats_raw"] = reps if args.raw else None
    return report


def _cell(st: dict[str, Any], fmt: str = "{:.2f}") -> str:
    if not st:
        return "-"
    return f"{fmt.format(st['median'])} ({fmt.format(st['min'])}-{fmt.format(st['max'])})"


def print_table(report: dict[str, Any]) -> None:
    print(
        f"{report['state']} state of {report['payload_bytes'] / MiB:.0f} MiB on {report['world_size']} ranks / {report['nodes']} nodes, "
        f"restored step {report['restored_step']}; median (min-max) of {report['repeats']} repeat(s)"
    )
    print("order: " + "; ".join(f"repeat {i + 1}: {', '.join(o)}" for i, o in enumerate(report["order"])))
    la = report["loadavg"]
    print(
        f"load average (1/5/15 min) at start {'/'.join(f'{x:.1f}' for x in la['start'])}, "
        f"at end {'/'.join(f'{x:.1f}' for x in la['end'])} on {report['cpus']} CPUs"
    )
    print(f"{'restore':<13}{'seconds':>22}{'MiB/s':>7}{'x vs persistent':>24}{'other CPUs':>20}  sources (per rank)")
    for m, r in report["restore"].items():
        sp = report["restore_speedup_vs_persistent"].get(m, {})
        src = " ".join(",".join(f"{k}={v}" for k, v in sorted((s or {"s3": "-"}).items())) for s in r["sources"])
        print(
            f"{m:<13}{_cell(r['seconds'], '{:.3f}'):>22}{r['mib_s']:>7.0f}{_cell(sp):>24}{_cell(r['other_cpus']):>20}  {src}"
        )
    if report["bytes_s3_vs_local"]:
        print(
            f"bytes only (each rank reads its own data file, nothing else): S3 takes {_cell(report['bytes_s3_vs_local'])}x "
            "the local tier's time"
        )
    s = report["save"]
    print("per save, slowest rank, seconds (first save of each manager left out):")
    for k in ("stall_s", "wait_s", "write_s", "replicate_s", "durable_s"):
        print(f"  local tier {k:<12}{_cell(s['local'][k], '{:.3f}'):>26}")
    print(
        f"  persist    {'seconds':<12}{_cell(s['persist']['seconds'], '{:.3f}'):>26}  ({s['persist']['bytes'] / MiB:.0f} MiB uploaded)"
    )
    for k in ("stall_s", "write_s", "durable_s"):
        print(f"  S3 one-tier {k:<11}{_cell(s['s3-one-tier'][k], '{:.3f}'):>26}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--size", default="128MiB", help="model + optimizer state in all (default 128MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--saves", type=int, default=4, help="two-tier saves per repeat (default 4)")
    ap.add_argument("--persist-every", type=int, default=2)
    ap.add_argument("--interval", type=float, default=2.0, help="seconds of (simulated) training between saves")
    ap.add_argument(
        "--state",
        choices=("fsdp2", "replicated"),
        default="fsdp2",
        help="fsdp2 (default): sharded over the 4 ranks; replicated: the whole state on every rank",
    )
    ap.add_argument("--methods", default=",".join(METHODS), type=lambda s: [m for m in s.split(",") if m])
    ap.add_argument(
        "--quiet", type=float, default=10.0, help="wait up to this long for a quiet machine before a restore"
    )
    ap.add_argument("--dir", default=None, help="scratch directory (default: the system's temp)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="the whole job's limit, seconds")
    ap.add_argument("--raw", action="store_true", help="keep every repeat's records in the JSON")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    if unknown := set(args.methods) - set(METHODS):
        ap.error(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    if args.saves % args.persist_every:
        ap.error("--saves must be a multiple of --persist-every (the restored step must be persisted)")
    report = run(args)
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
