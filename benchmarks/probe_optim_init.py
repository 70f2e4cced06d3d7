"""What a restore into a fresh optimizer pays before DCP loads: torch's state initialization
against the state shaped from the checkpoint (``goodput_ckpt/state/optim_state.py``).

Times, in one process, for a fresh ``nn.Sequential`` of ``--layers`` square ``Linear`` layers
and a fresh AdamW each time:

- ``torch-init``: ``torch.distributed.checkpoint.state_dict._init_optim_state``, what
  ``get_state_dict`` runs on an optimizer without state (one ``step()`` with zero gradients);
- ``zeros``: allocating the same state zero-filled (``zeros_like``);
- ``empty``: allocating it uninitialized (``empty_like``), what the shaped state does.

Prints min / median / max over ``--repeats``, methods in a rotating order.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/probe_optim_init.py --width 4096 --layers 5 --repeats 5``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _fresh(width: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _alloc(opt: torch.optim.Optimizer, like) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": like(p), "exp_avg_sq": like(p)}


def main(argv: list[str]) -> int:
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    methods = {
        "torch-init": _init_optim_state,
        "zeros": lambda o: _alloc(o, torch.zeros_like),
        "empty": lambda o: _alloc(o, torch.empty_like),
    }
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    orders = []
    for r in range(a.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        orders.append("".join(n[0] for n in order))
        for name in order:
            model, opt = _fresh(a.width, a.layers)  # untimed: a fresh model and optimizer
            t0 = time.perf_counter()
            methods[name](opt)
            times[name].append(time.perf_counter() - t0)
            del model, opt
    mib = a.layers * (a.width * a.width + a.width) * 4 / (1 << 20)
    print(f"AdamW over {mib:.0f} MiB of fp32 parameters; order {' '.join(orders)} (t torch-init, z zeros, e empty)")
    base = statistics.median(times["torch-init"])
    for name in names:
        t = sorted(times[name])
        print(
            f"  {name:10s} min {t[0]:.4f} / median {statistics.median(t):.4f} / max {t[-1]:.4f} s; "
            f"torch-init / this {base / max(statistics.median(t), 1e-9):.1f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
