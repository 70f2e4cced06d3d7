"""Incremental saves (issue 40): bytes and time per save of a LoRA and of a frozen-embeddings
fine-tune, with and without ``CheckpointManager(incremental=...)``, and the restore of an
incremental step against a full one, on local disk and (``--s3``) S3.

Models are GPT-2-style, built from a ``transformers`` config (no download). Scenarios:

- ``lora``: the whole GPT-2 base frozen, a rank-8 LoRA adapter on every block's ``c_attn``
  (the layer peft's default targets for GPT-2; the adapter is a few lines here because peft is
  not installed in this environment), AdamW over the adapters. Three managers in the same run,
  on the same live model, each a save after every ``--every`` training steps:
  ``full`` (incremental off), ``incremental`` (on), and ``trainable`` (incremental off, saving
  only a module that holds the adapters, with the same optimizer: the trainable state alone,
  what the targets compare against). Targets: bytes written per save after the first <= 1.1x
  ``trainable``'s; save time <= 1.2x ``trainable``'s; stall unchanged (``--stall``: async saves
  of ``full`` and ``incremental``, the time ``save`` blocks).
- ``embeddings``: a full fine-tune with ``wte``/``wpe`` frozen: bytes written per save drop by
  the frozen share (``full`` vs ``incremental``).

Bytes written are the step directory's files (data files and manifest) after the save, the same
measure for every method; the incremental manager's own counters (timeline ``written_bytes``)
are reported too. Saves are synchronous (``async_save=False``) so that a save's time is its
wall time; the saving process's CPU time (every thread, not the S3 server's) is recorded beside
it, a measure that the load of a shared machine moves less. Each figure is the median over ``--repeats`` runs (each run: ``--saves`` saves per
method, methods in rotated order), with min and max as the spread. Restore: the newest step of
``full`` and of ``incremental`` (which references the first step) into a fresh model, verified
bit-exact; on S3 the server's request counters are read before and after each restore.

Run: ``.venv/bin/python benchmarks/bench_incremental.py --repeats 3 --s3 --json incremental.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the SeaweedFS recipe
from helpers.s3 import SeaweedServer, free_port, s3_env  # noqa: E402

from goodput_ckpt import CheckpointManager  # noqa: E402

warnings.filterwarnings("ignore")
MiB = 1 << 20


# -- models ----------------------------------------------------------------------------------------
class LoRA(nn.Module):
    """``y = base(x) + (x @ A.T @ B.T) * alpha / r`` around a GPT-2 ``Conv1D`` (weight ``in x out``)."""

    def __init__(self, base: nn.Module, rank: int = 8, alpha: int = 16) -> None:
        super().__init__()
        self.base = base
        n_in, n_out = base.weight.shape
        self.lora_A = nn.Parameter(torch.randn(rank, n_in) / n_in**0.5)
        self.lora_B = nn.Parameter(torch.zeros(n_out, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scale


def gpt2(layers: int, width: int, seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=8, n_positions=256, vocab_size=50257)
    return GPT2LMHeadModel(cfg)


def lora_model(layers: int, width: int, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """The model and a module holding only its adapters (the trainable state alone)."""
    model = gpt2(layers, width, seed)
    model.requires_grad_(False)
    adapters = nn.ModuleDict()
    for i, block in enumerate(model.transformer.h):
        block.attn.c_attn = LoRA(block.attn.c_attn)
        adapters[str(i)] = block.attn.c_attn
    # The adapters module must not save the base weights: only the LoRA parameters.
    trainable = nn.ParameterDict(
        {f"{i}_{n}": p for i, m in adapters.items() for n, p in m.named_parameters() if p.requires_grad}
    )
    return model, trainable


def embeddings_model(layers: int, width: int, seed: int = 0) -> nn.Module:
    model = gpt2(layers, width, seed)
    model.transformer.wte.requires_grad_(False)
    model.transformer.wpe.requires_grad_(False)
    return model


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for _ in range(n):
        ids = torch.randint(0, 50257, (2, 32), generator=g)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def tree_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- measuring -------------------------------------------------------------------------------------
def step_bytes(root: str, step: int) -> int:
    d = os.path.join(root, f"step_{step:08d}")
    return sum(e.stat().st_size for e in os.scandir(d) if e.is_file())


def s3_step_bytes(client: Any, bucket: str, prefix: str, step: int) -> int:
    out = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step_{step:08d}/")
    return sum(o["Size"] for o in out.get("Contents", ()))


def request_counts(metrics_url: str, bucket: str) -> Counter:
    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    out: Counter = Counter()
    for line in text.splitlines():
        if line.startswith("SeaweedFS_s3_request_total{") and f'bucket="{bucket}"' in line:
            labels, value = line.rsplit(" ", 1)
            out[labels.split('type="', 1)[1].split('"', 1)[0]] += int(float(value))
    return out


class Target:
    """Where the roots go: a local scratch directory or an S3 bucket on a SeaweedFS server."""

    def __init__(self, s3: bool) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="bench-incremental-"))
        self.server = None
        if s3:
            os.environ.update(s3_env())
            metrics = free_port(55635)
            self.server = SeaweedServer(self.scratch / "weed", extra_args=(f"-metricsPort={metrics}",))
            self.metrics = f"http://127.0.0.1:{metrics}/metrics"
            import boto3
            from botocore.config import Config

            self.client = boto3.client(
                "s3",
                endpoint_url=self.server.url,
                region_name="us-east-1",
                config=Config(s3={"addressing_style": "path"}),
            )
            self.client.create_bucket(Bucket="bench")
            self.options = {"endpoint_url": self.server.url, "addressing_style": "path", "region": "us-east-1"}
        else:
            self.options = {}

    def root(self, name: str) -> str:
        return f"s3://bench/{name}" if self.server else str(self.scratch / name)

    def bytes(self, name: str, step: int) -> int:
        return s3_step_bytes(self.client, "bench", name, step) if self.server else step_bytes(self.root(name), step)

    def requests(self) -> Counter:
        return request_counts(self.metrics, "bench") if self.server else Counter()

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.scratch, ignore_errors=True)


def run_scenario(scenario: str, rep: int, args: argparse.Namespace, target: Target) -> dict[str, Any]:
    """One run of one scenario: per method, bytes and seconds of every save, and the restores."""
    if scenario == "lora":
        model, trainable = lora_model(args.layers, args.width)
        params = list(trainable.values())
        methods = {"full": model, "incremental": model, "trainable": trainable}
    else:
        model, trainable = embeddings_model(args.layers, args.width), None
        params = [p for p in model.parameters() if p.requires_grad]
        methods = {"full": model, "incremental": model}
    opt = torch.optim.AdamW(params, lr=1e-4)
    managers = {
        m: CheckpointManager(
            target.root(f"{scenario}-{m}-{rep}"),
            keep_last=2,
            async_save=False,
            incremental=(m == "incremental"),
            timeline=False,
            **target.options,
        )
        for m in methods
    }
    out: dict[str, Any] = {
        m: {"bytes": [], "seconds": [], "cpu_seconds": [], "written_bytes": [], "requests": []} for m in methods
    }
    order = list(methods)
    for i in range(1, args.saves + 1):
        train_steps(model, opt, args.every, 100 * rep + i)
        order = order[1:] + order[:1]
        for m in order:
            before = target.requests()  # the server's counters: not the timed part
            c0 = time.process_time()  # this process's CPU, every thread: the load's swing aside
            t0 = time.perf_counter()
            managers[m].save(i, model=methods[m], optimizer=opt)
            out[m]["seconds"].append(time.perf_counter() - t0)
            out[m]["cpu_seconds"].append(time.process_time() - c0)
            out[m]["requests"].append(dict(target.requests() - before))  # before the step's LIST below
            out[m]["bytes"].append(target.bytes(f"{scenario}-{m}-{rep}", i))
            rec = managers[m].timeline[-1]
            out[m]["written_bytes"].append(rec.get("written_bytes"))
    for mgr in managers.values():
        mgr.close()
    # Restores alternate between the two (the order rotates), several each: the median is kept.
    rounds: dict[str, list[dict[str, Any]]] = {"full": [], "incremental": []}
    for k in range(args.restores):
        for m in ["full", "incremental"] if k % 2 == 0 else ["incremental", "full"]:
            rounds[m].append(restore(scenario, m, rep, model, args, target))
    for m, rs in rounds.items():
        out[m]["restore"] = {
            "seconds": statistics.median(r["seconds"] for r in rs),
            "all_seconds": [r["seconds"] for r in rs],
            "requests": rs[-1]["requests"],
        }
    if args.stall:  # after the restores: it trains on
        out["stall"] = stall(scenario, model, methods, opt, rep, args, target)
    # The frozen bytes of the state dict (GPT-2 ties lm_head to wte: both keys are saved).
    trainable_ptrs = {p.data_ptr() for p in model.parameters() if p.requires_grad}
    out["frozen_bytes"] = sum(
        t.numel() * t.element_size() for t in model.state_dict().values() if t.data_ptr() not in trainable_ptrs
    )
    return out


def stall(scenario, model, methods, opt, rep, args, target) -> dict[str, list[float]]:
    """The time an async ``save`` blocks, full vs incremental (default async staging)."""
    res: dict[str, list[float]] = {"full": [], "incremental": []}
    managers = {
        m: CheckpointManager(
            target.root(f"{scenario}-stall-{m}-{rep}"),
            keep_last=2,
            incremental=(m == "incremental"),
            timeline=False,
            **target.options,
        )
        for m in res
    }
    for i in range(1, args.saves + 1):
        for m in list(managers) if i % 2 else list(managers)[::-1]:  # alternating order
            mgr = managers[m]
            t0 = time.perf_counter()
            mgr.save(i, model=methods[m], optimizer=opt)
            blocked = time.perf_counter() - t0
            train_steps(model, opt, 1, 7000 + i)  # the next optimizer step waits for the rest of the copy
            mgr.wait()
            res[m].append(blocked + mgr.timeline[-1]["guard_s"])
    for mgr in managers.values():
        mgr.close()
    return res


def restore(scenario, method, rep, live, args, target) -> dict[str, Any]:
    fresh = (
        lora_model(args.layers, args.width, seed=1)[0]
        if scenario == "lora"
        else embeddings_model(args.layers, args.width, seed=1)
    )
    opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-4)
    mgr = CheckpointManager(target.root(f"{scenario}-{method}-{rep}"), keep_last=2, timeline=False, **target.options)
    before = target.requests()
    t0 = time.perf_counter()
    step = mgr.restore(model=fresh, optimizer=opt)
    seconds = time.perf_counter() - t0
    requests = dict(target.requests() - before)
    mgr.close()
    if step != args.saves or not tree_equal(fresh.state_dict(), live.state_dict()):
        raise SystemExit(f"{scenario}/{method}: the restored state differs from the saved one")
    return {"seconds": seconds, "requests": requests}


# -- the report ------------------------------------------------------------------------------------
def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for scenario, reps in runs.items():
        s: dict[str, Any] = {"frozen_bytes": reps[0]["frozen_bytes"]}
        for m in ("full", "incremental", "trainable"):
            if m not in reps[0]:
                continue
            later = [b for r in reps for b in r[m]["bytes"][1:]]  # after the first save
            secs = [x for r in reps for x in r[m]["seconds"][1:]]
            s[m] = {
                "bytes_first": statistics.median(r[m]["bytes"][0] for r in reps),
                "bytes_later": spread(later),
                "seconds_later": spread(secs),
                "save_requests": reps[-1][m]["requests"][-1],  # the last save of the last run (S3)
            }
            if m != "trainable":
                s[m]["restore_s"] = spread([r[m]["restore"]["seconds"] for r in reps])
                s[m]["restore_requests"] = reps[-1][m]["restore"]["requests"]

        # Same-run ratios, each run's medians first, then their spread over the runs.
        def per_run(fn):
            return spread([fn(r) for r in reps])

        def med(r, m, key):
            return statistics.median(r[m][key][1:])

        if "trainable" in s:
            s["bytes_vs_trainable"] = per_run(lambda r: med(r, "incremental", "bytes") / med(r, "trainable", "bytes"))
            s["seconds_vs_trainable"] = per_run(
                lambda r: med(r, "incremental", "seconds") / med(r, "trainable", "seconds")
            )
            if "cpu_seconds" in reps[0]["trainable"]:  # the saving process's CPU time (not the server's)
                s["cpu_vs_trainable"] = per_run(
                    lambda r: med(r, "incremental", "cpu_seconds") / med(r, "trainable", "cpu_seconds")
                )
        s["bytes_vs_full"] = per_run(lambda r: med(r, "incremental", "bytes") / med(r, "full", "bytes"))
        s["seconds_vs_full"] = per_run(lambda r: med(r, "incremental", "seconds") / med(r, "full", "seconds"))
        s["frozen_share_of_full"] = per_run(lambda r: r["frozen_bytes"] / med(r, "full", "bytes"))
        s["restore_vs_full"] = per_run(
            lambda r: r["incremental"]["restore"]["seconds"] / r["full"]["restore"]["seconds"]
        )
        # Each restore round's pair (adjacent in time, order alternating): incremental / full.
        s["restore_pairs_vs_full"] = spread(
            [
                i / f
                for r in reps
                for i, f in zip(r["incremental"]["restore"]["all_seconds"], r["full"]["restore"]["all_seconds"])
            ]
        )
        if "stall" in reps[0]:
            s["stall_ms"] = {
                m: spread([1e3 * statistics.median(r["stall"][m][1:]) for r in reps]) for m in ("full", "incremental")
            }
            # Every save after the first, all runs: the spread of single stalls, and each save's
            # incremental stall over the full one of the same save index (taken back to back).
            s["stall_each_ms"] = {
                m: spread([1e3 * x for r in reps for x in r["stall"][m][1:]]) for m in ("full", "incremental")
            }
            s["stall_pairs_vs_full"] = spread(
                [i / f for r in reps for i, f in zip(r["stall"]["incremental"][1:], r["stall"]["full"][1:])]
            )
        report[scenario] = s
    return report


def print_report(report: dict[str, Any], where: str) -> None:
    for scenario, s in report.items():
        print(f"\n== {scenario} ({where}); frozen {s['frozen_bytes'] / MiB:.1f} MiB")
        for m in ("full", "incremental", "trainable"):
            if m in s:
                r = s[m]
                line = (
                    f"  {m:12s} first {r['bytes_first'] / MiB:8.2f} MiB  later {r['bytes_later']['median'] / MiB:8.3f} MiB"
                    f"  save {1e3 * r['seconds_later']['median']:7.1f} ms {r['save_requests'] or ''}"
                )
                if "restore_s" in r:
                    line += f"  restore {1e3 * r['restore_s']['median']:7.1f} ms {r['restore_requests'] or ''}"
                print(line)
        for k in (
            "bytes_vs_trainable",
            "seconds_vs_trainable",
            "cpu_vs_trainable",
            "bytes_vs_full",
            "seconds_vs_full",
            "frozen_share_of_full",
            "restore_vs_full",
            "restore_pairs_vs_full",
            "stall_pairs_vs_full",
        ):
            if k in s:
                v = s[k]
                print(f"  {k:22s} {v['median']:.3f} (min {v['min']:.3f}, max {v['max']:.3f})")
        if "stall_ms" in s:
            print(
                "  stall ms "
                + ", ".join(f"{m} {v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f})" for m, v in s["stall_ms"].items())
            )
            print(
                "  each stall ms "
                + ", ".join(
                    f"{m} {v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f})" for m, v in s["stall_each_ms"].items()
                )
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--saves", type=int, default=4, help="saves per method and run")
    p.add_argument("--every", type=int, default=1, help="training steps between saves")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--restores", type=int, default=3, help="restores per method and run (alternating)")
    p.add_argument("--scenarios", default="lora,embeddings")
    p.add_argument("--stall", action="store_true", help="also time async saves' stall")
    p.add_argument("--s3", action="store_true", help="also run on S3 (SeaweedFS)")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    full: dict[str, Any] = {
        "args": vars(args),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "loadavg_start": os.getloadavg(),
    }
    for where in ["local"] + (["s3"] if args.s3 else []):
        target = Target(where == "s3")
        try:
            runs: dict[str, list[dict[str, Any]]] = {}
            for rep in range(args.repeats):
                for scenario in args.scenarios.split(","):
                    runs.setdefault(scenario, []).append(run_scenario(scenario, rep, args, target))
                    print(f"{where}: {scenario} run {rep} done", file=sys.stderr, flush=True)
        finally:
            target.close()
        full[where] = summarize(runs)
        print_report(full[where], where)
    full["loadavg_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(full, indent=1))


if __name__ == "__main__":
    main()
