"""``bench --plot``: a bar chart of a :class:`~._bench_report.BenchReport` (matplotlib, optional).

matplotlib is an optional extra (``pip install 'goodput-ckpt[plot]'``). The chart is drawn on a
bare ``Figure`` (no ``pyplot``), so it changes no global matplotlib state and needs no display.
"""

from __future__ import annotations

import os

from ._bench_report import BenchReport

__all__ = ["PLOT_EXTRA_HINT", "plot_report", "require_matplotlib"]

PLOT_EXTRA_HINT = "pip install 'goodput-ckpt[plot]' (or pip install matplotlib)"
_COLORS = {"goodput": "#2a7ab0", "torch": "#e07b39"}


def require_matplotlib() -> None:
    """Check that the chart can be drawn, before a long bench runs.

    Raises:
        ImportError: matplotlib is not installed; the message says how to install it.
    """
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError as e:
        raise ImportError(f"plotting needs matplotlib, which is not installed: {PLOT_EXTRA_HINT}") from e


def plot_report(report: BenchReport, path: str | os.PathLike) -> None:
    """Write a PNG (or any format matplotlib infers from ``path``) of ``report``.

    Left: save, load and verify GB/s per method. Right: seconds of a synchronous save and the
    stall of an async one, per method. A method that could not run is marked ``n/a`` in the legend.

    Raises:
        ImportError: matplotlib is not installed.
    """
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(10, 4.2), layout="constrained")
    rate_ax, time_ax = fig.subplots(1, 2, width_ratios=(3, 2))
    groups = (("save", "save_gbps"), ("load", "load_gbps"), ("verify", "verify_gbps"))
    times = (("sync save", "save_s"), ("async stall", "stall_s"))
    width = 0.8 / len(report.methods)
    legend = []  # explicit handles: a method with no bars still gets its colour in the legend
    for i, m in enumerate(report.methods):
        label = m.name if m.available else f"{m.name} (n/a)"
        color = _COLORS.get(m.name, "gray")
        legend.append(Patch(color=color, label=label))
        offset = (i - (len(report.methods) - 1) / 2) * width
        rates = [getattr(m, attr) for _, attr in groups]
        _bars(rate_ax, [x + offset for x in range(len(groups))], rates, width, color, "{:.2f}")
        secs = [m.median(s) for _, s in times]
        _bars(time_ax, [x + offset for x in range(len(times))], secs, width, color, "{:.3g}")
    rate_ax.set_xlim(-0.5, len(groups) - 0.5)  # bars that are n/a still get their place
    time_ax.set_xlim(-0.5, len(times) - 0.5)
    rate_ax.set_xticks(range(len(groups)), [g for g, _ in groups])
    rate_ax.set_ylabel("GB/s (1e9 bytes; higher is better)")
    rate_ax.legend(handles=legend, loc="upper left")
    for ax in (rate_ax, time_ax):
        ax.margins(y=0.2)  # room above the tallest bar for its label (and the legend)
    time_ax.set_xticks(range(len(times)), [t for t, _ in times])
    time_ax.set_ylabel("seconds per save (lower is better)")
    cache = {True: "cold cache", False: "warm cache", None: "remote"}[report.cold_cache]
    fig.suptitle(
        f"goodput-ckpt bench: {report.size_bytes / 2**20:.0f} MiB state on {report.backend} storage "
        f"({cache}), median of {report.repeats}"
    )
    fig.savefig(os.fspath(path), dpi=120)


def _bars(ax, xs: list[float], values: list[float | None], width: float, color: str, fmt: str) -> None:
    """Bars labelled with their values; a missing value is written ``n/a`` where its bar would be."""
    shown = [(x, v) for x, v in zip(xs, values) if v is not None]
    bars = ax.bar([x for x, _ in shown], [v for _, v in shown], width, color=color)
    ax.bar_label(bars, labels=[fmt.format(v) for _, v in shown], fontsize=8, padding=2)
    for x, v in zip(xs, values):
        if v is None:
            ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=8, color=color)
