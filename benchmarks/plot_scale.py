"""Plot bench_scale.py's JSON: each phase's median (min-max bars) in seconds against the number
of ranks W, log-log, with the 1 s goal line. Writes a PNG (matplotlib) and prints the medians as
a markdown table, so docs/scale.md's figures come from the same files.

Run: ``.venv/bin/python benchmarks/plot_scale.py torch.json ours.json --png docs/scale.png`` (later
files win where both measured a phase at the same W). ``--totals`` plots, instead of the phases,
what the goals are about (the coordinator's first save and restore, each other rank's restore)
for every ``--state`` in the files, so two states measured in one run sit side by side.
"""

from __future__ import annotations

import argparse
import json
import sys

PHASES = {  # phase -> legend (what docs/scale.md calls it)
    "v2.gather": "write results gathered (pickle round trip)",
    "v2.build": "commit record built, first save",
    "v2.build_same": "commit record built, later saves",
    "v2.serialize": "serialize",
    "v2.write": "write (fsync + rename)",
    "v2.parse": "parse + validate",
    "v2.share_dumps": "parsed record pickled for the ranks (coordinator)",
    "v2.share_loads": "parsed record unpickled (each other rank)",
    "v2.rebuild": "rebuild DCP Metadata",
    "v2.plan": "one rank's read plan",
    "torch.gather": "torch: write results gathered",
    "torch.loads": "torch: unpickle .metadata",
}


def load_rows(paths: list[str]) -> list[dict]:
    """One row per (model, mesh, state, W): the files' phases merged, a later file's winning (so
    torch's phases can come from a run at small W and ours from a run over every W). Files from
    before ``--state`` existed measured the bare state."""
    merged: dict[tuple, dict] = {}
    for p in paths:
        with open(p) as f:
            for r in json.load(f)["rows"]:
                r.setdefault("state", "bare")
                key = (r["model"], r["mesh"], r["state"], r["world"])
                if key in merged:
                    merged[key]["phases"].update(r["phases"])
                else:
                    merged[key] = {**r, "phases": dict(r["phases"])}
    return [merged[k] for k in sorted(merged)]


def table(rows: list[dict]) -> str:
    worlds = [r["world"] for r in rows]
    head = "| phase | " + " | ".join(f"W = {w:,}" for w in worlds) + " |"
    out = [head, "|---|" + "---|" * len(worlds)]
    for ph, label in PHASES.items():
        cells = []
        for r in rows:
            p = r["phases"].get(ph)
            cells.append("" if p is None else f"{p['median']:.3g} ({p['min']:.3g}-{p['max']:.3g})")
        if any(cells):
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


TOTALS = {  # bench_scale's sums of phase medians -> legend
    "v2_save_s": "coordinator, first save",
    "v2_restore_s": "coordinator, restore",
    "v2_rank_restore_s": "each other rank's restore",
}


def _plot_totals(ax, rows: list[dict]) -> None:
    """One line per (state, total): sums of medians, so no bars."""
    for state in sorted({r["state"] for r in rows}):
        mine = sorted((r for r in rows if r["state"] == state), key=lambda r: r["world"])
        for color, (key, label) in enumerate(TOTALS.items()):  # a total keeps its colour across states
            pts = [(r["world"], r[key]) for r in mine if key in r]
            if pts:
                style = "--" if state.endswith("-v1") else "-"
                ax.plot(*zip(*pts), marker="o", color=f"C{color}", linestyle=style, label=f"{state}: {label}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--png", help="write the plot here")
    ap.add_argument("--totals", action="store_true", help="plot the goals' sums per state, not the phases")
    args = ap.parse_args(argv)
    rows = load_rows(args.json)
    print(table(rows))
    if args.png:
        import matplotlib  # noqa: PLC0415 - only for the plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        fig, ax = plt.subplots(figsize=(11, 5.5))
        if args.totals:
            _plot_totals(ax, rows)
        for ph, label in ({} if args.totals else PHASES).items():
            pts = [(r["world"], r["phases"][ph]) for r in rows if ph in r["phases"]]
            if not pts:
                continue
            w = [x for x, _ in pts]
            med = [p["median"] for _, p in pts]
            err = [[m - p["min"] for m, (_, p) in zip(med, pts)], [p["max"] - m for m, (_, p) in zip(med, pts)]]
            ax.errorbar(
                w, med, yerr=err, marker="o", capsize=3, label=label, linestyle="--" if ph.startswith("torch") else "-"
            )
        ax.axhline(1.0, color="red", linewidth=0.8, label="goal: 1 s per save / restore")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks W")
        ax.set_ylabel("seconds (sum of phase medians)" if args.totals else "seconds (median, bars: min-max)")
        r0 = rows[0]
        states = sorted({r["state"] for r in rows})
        ax.set_title(
            f"Commit record cost against W: {r0['model']} {r0['mesh']}, {'/'.join(states)} state, {r0['tensors']:,} tensors at W = {r0['world']:,}"
        )
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
