"""The rotation, summary and command line that ``bench_hf.py`` and ``bench_lightning.py`` share.

Both time a real trainer's checkpoint plugin against ours on the same seeded run, one run per
method and repeat; they differ only in the trainer and in what they time (:func:`main`'s
``run_once``). What a figure means is decided here once, with the procedure of
``goodput_ckpt/tools/measure/_bench_measure.py``:

- each repeat runs the methods in an order rotated by one (:func:`run_rotation`), so no method
  always follows the same one;
- each figure is reported as min / median / max over the repeats (:func:`spread_of`);
- a method is compared with the trainer's stock plugin per repeat: ``stock seconds / method
  seconds`` of the same repeat (above 1: the method is faster), reported as min / median / max
  (:func:`ratio_spread`), so that a repeat disturbed by other jobs moves both sides of a ratio.

The first save of each run is the benchmark's own warm-up and is left out by ``run_once``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from goodput_ckpt.tools.measure._bench_measure import ratio_spread, run_rotation, spread_of

__all__ = ["main", "summarize"]


def summarize(
    results: Mapping[str, Sequence[Mapping[str, float]]],
    keys: Sequence[str],
    baseline_of: Mapping[str, str],
) -> dict[str, Any]:
    """Per method and figure its spread over the repeats, and per compared method and figure its
    per-repeat ratio to its baseline (``baseline_of[method]``; a method missing there is not
    compared)."""
    out: dict[str, Any] = {}
    for m, rs in results.items():
        out[m] = {k: spread_of([r[k] for r in rs]) for k in keys}
        base = baseline_of.get(m)
        if base is None:
            continue
        ratios = {}
        for k in keys:
            rs_ = ratio_spread([r[k] for r in rs], [r[k] for r in results[base]])
            if rs_ is not None:
                ratios[k] = {"min": rs_.min, "median": rs_.median, "max": rs_.max, "all": list(rs_.per_repeat)}
        out[m]["vs"] = {"baseline": base, **ratios}
    return out


def _print(summary: dict[str, Any], names: Sequence[str], keys: Sequence[str]) -> None:
    print(
        f"checkpoint about {summary['checkpoint_mib']} MiB of tensors, {summary['repeats']} repeats, "
        f"load average {summary['load_average'][0]} -> {summary['load_average'][1]} "
        "(seconds, min / median / max)"
    )
    for m in names:
        row = "   ".join(
            f"{k[:-2]} " + " / ".join(f"{summary[m][k][f]:.3f}" for f in ("min", "median", "max")) for k in keys
        )
        print(f"  {m:14s} {row}")
    print("same-repeat ratios, baseline seconds / method seconds (above 1: faster), min / median / max")
    for m in names:
        vs = summary[m].get("vs")
        if vs is None:
            continue
        row = "   ".join(
            f"{k[:-2]} " + " / ".join(f"{vs[k][f]:.2f}" for f in ("min", "median", "max")) + "x"
            for k in keys
            if k in vs
        )
        print(f"  {m:14s} vs {vs['baseline']:12s} {row}")


def main(
    doc: str,
    methods: Sequence[str],
    run_once: Callable[[str, str, argparse.Namespace], dict[str, float]],
    *,
    keys: Sequence[str],
    baseline_of: Mapping[str, str],
    steps_flag: str,
    prefix: str,
) -> None:
    """The command line of a plugin benchmark: ``--width --layers STEPS_FLAG --repeats --dir --json``.

    ``run_once(method, root, args)`` trains one run of ``method`` under ``root`` and returns its
    figures (``keys``, seconds); it is called for every repeat and method in rotated order.
    """
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(steps_flag, type=int, default=4, help="saves per run, the first a warm-up (default 4)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    steps = getattr(args, steps_flag.lstrip("-"))
    if args.repeats < 3 or steps < 2:
        ap.error(f"--repeats must be at least 3 and {steps_flag} at least 2 (the first save is a warm-up)")
    load_start = os.getloadavg()[0]
    root = tempfile.mkdtemp(prefix=prefix, dir=args.dir)
    results: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    try:
        order = run_rotation(methods, args.repeats, lambda m, _rep: results[m].append(run_once(m, root, args)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    params = args.layers * (args.width * args.width + args.width)
    summary = {
        "checkpoint_mib": round(params * 4 * 3 / 2**20, 1),  # weights + the optimizer's two moments, fp32
        "repeats": args.repeats,
        "order": order,
        "load_average": [round(load_start, 1), round(os.getloadavg()[0], 1)],
        **summarize(results, keys, baseline_of),
    }
    if args.json:
        print(json.dumps(summary))
        return
    _print(summary, methods, keys)
