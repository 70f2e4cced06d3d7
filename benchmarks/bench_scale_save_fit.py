"""Extrapolate ``bench_scale_save.py``'s figures to 1,024 - 16,384 ranks from its JSON files.

For each method, save (1: first, 2: later) and figure (the coordinator's and rank 1's median CPU
seconds, the bytes of each payload, the coordinator's peak), a least-squares line ``a + b W``
through the measured W (all of them, unweighted) gives the estimate at the larger W. A line is
the growth the code has where its work is per rank (digests, file entries, reports): a
figure that grows faster than linearly would be underestimated, so the fit's largest relative
residual at the measured points is printed beside it. A slope of zero or below (no growth that
the noise lets through) gives the largest measured value. With fewer than two W a figure is not
extrapolated.

Run: ``python benchmarks/bench_scale_save_fit.py docs/scale/save/a.json docs/scale/save/b.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any

TARGETS = (1024, 4096, 16384)


def fit(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """``(a, b, worst relative residual)`` of the least-squares line ``a + b W``."""
    n = len(points)
    mx = sum(w for w, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((w - mx) ** 2 for w, _ in points)
    b = sum((w - mx) * (y - my) for w, y in points) / sxx
    a = my - b * mx
    worst = max(abs(a + b * w - y) / abs(y) if y else 0.0 for w, y in points)
    return a, b, worst


def figures(row: dict[str, Any], save: str) -> dict[str, float]:
    r = row["saves"][save]
    out = {"coordinator cpu s": r["coordinator cpu s"]["median"], "rank 1 cpu s": r["rank 1 cpu s"]["median"]}
    out.update({f"{k} (bytes)": float(v) for k, v in r["bytes"].items()})
    if r.get("coordinator peak MB") is not None:
        out["coordinator peak MB"] = float(r["coordinator peak MB"])
    for k, v in (r.get("coordinator peak windows") or {}).items():  # the peak's two windows, when recorded
        out[f"coordinator {k}"] = float(v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+")
    args = ap.parse_args(argv)
    series: dict[tuple[str, str, str], list[tuple[int, float]]] = defaultdict(list)
    for path in args.json:
        with open(path) as f:
            for row in json.load(f)["rows"]:
                for save in row["saves"]:
                    for name, value in figures(row, save).items():
                        series[row["method"], save, name].append((row["world"], value))
    print("figure: measured W=value ...; fit a + b W; estimates at " + ", ".join(f"W={w:,}" for w in TARGETS))
    for (method, save, name), points in sorted(series.items()):
        points.sort()
        label = f"{method}, {'first' if save == '1' else 'later'} save, {name}"
        measured = "; ".join(f"W={w}: {v:,.3g}" for w, v in points)
        if len({w for w, _ in points}) < 2:
            print(f"{label}: {measured} (one W: not extrapolated)")
            continue
        a, b, worst = fit(points)
        if b <= 0:  # no growth the noise lets through: the largest measured value stands
            print(f"{label}: {measured}; no growth with W resolved (b={b:,.3g}); est. {max(v for _, v in points):,.3g}")
            continue
        est = ", ".join(f"{a + b * w:,.3g}" for w in TARGETS)
        print(f"{label}: {measured}; a={a:,.4g} b={b:,.4g}/rank (worst residual {worst:.0%}); est. {est}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
