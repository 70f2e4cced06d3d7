"""The text report of ``goodput-ckpt demo --tiers``: one tier and two tiers side by side."""

from __future__ import annotations

from ..tools.demos.results import DemoMode, ResumedRun, TierDemoReport
from ._output import Output, table


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f} ms"


def _restored(m: DemoMode) -> str:
    if m.restored_step is None:
        return "nothing"
    if not m.restore_files:
        return f"step {m.restored_step} from {', '.join(m.restored_from)}"
    files = ", ".join(f"{tier} {n}" for tier, n in m.restore_files.items())
    return f"step {m.restored_step} ({files} files)"


def _cost(m: ResumedRun) -> float:
    """What the tier layout changes, measured directly: stall, lost work and restore (the rest,
    ``other``, mixes the slowdown from background writes with run-to-run noise)."""
    return m.seconds["stall"] + m.seconds["lost"] + m.seconds["restore"]


def _checked(m: ResumedRun) -> str:
    bad = [c for c in m.checkpoints if not c["ok"]]
    if bad:
        return f"{len(bad)} of {len(m.checkpoints)} FAILED"
    return f"{len(m.checkpoints)} verified"


def _model_lines(r: TierDemoReport) -> list[str]:
    p = r.model
    if p is None:
        return ["Two-level model: not enough was measured (no background save or persist recorded)."]
    one = p.one_level
    return [
        f"Two-level model (goodput-ckpt plan) for the measured costs, with a node MTBF of {r.node_mtbf / 3600:.1f} h",
        f"and a job MTBF of {r.job_mtbf / 3600:.1f} h, over a long run:",
        f"  two tiers  {100 * p.goodput:.3f} %  (a local save every {p.local_interval:.1f} s of training, persist_every {p.persist_every})",
        f"  one tier   {100 * one.goodput_at_optimum:.3f} %  (a persistent save every {one.optimal_interval:.1f} s, Daly)",
        f"  gain       {p.gain:+.3f} percentage points",
    ]


def render_tiers(r: TierDemoReport, out: Output) -> None:
    """Print a :class:`~goodput_ckpt.tools.demos.results.TierDemoReport`."""
    one, two = r.modes
    nodes = f"{r.world_size} ranks as {r.nodes} nodes of {r.local_world_size}"
    out.print(
        f"\ngoodput-ckpt demo --tiers: {nodes} on {r.device}, {r.steps} steps, async save every {r.save_every} steps"
    )
    lost = "" if r.lost_node is None else f", then node {r.lost_node}'s local directory deleted (a lost node)"
    out.print(f"failure: SIGKILL of the whole job after step {r.killed_after_step}{lost}")
    out.print(f"one tier:  every save to {one.root}")
    out.print(f"two tiers: every save to {two.local_dir} with a replica on the other node,")
    out.print(f"           1 save in {two.persist_every} also to {two.root} (in the background)\n")

    def secs(key: str) -> list[str]:
        return [f"{m.seconds[key]:.2f} s" for m in (one, two)]

    rows = [
        [
            "resumed bit for bit",
            *("yes" if m.bit_exact else f"NO ({len(m.mismatches)} values differ)" for m in (one, two)),
        ],
        ["restored", *(_restored(m) for m in (one, two))],
        ["stall per save", *(_ms(m.stall_per_save_s) for m in (one, two))],
        ["background per save", *(_ms(m.background_per_save_s) for m in (one, two))],
        ["persist (background)", "-", _ms(two.persist_per_save_s)],
        ["training", *secs("training")],
        ["stall", *secs("stall")],
        ["lost work", *secs("lost")],
        ["restart", *secs("restart")],
        ["restore", *secs("restore")],
        ["other (background writes, noise)", *secs("other")],
        ["total", *secs("total")],
        ["checkpoint cost (stall + lost work + restore)", *(f"{_cost(m):.2f} s" for m in (one, two))],
        ["GOODPUT", *(f"{100 * m.goodput:.1f} %" for m in (one, two))],
        ["checkpoints", *(_checked(m) for m in (one, two))],
    ]
    out.print(table(["", "ONE TIER", "TWO TIERS"], rows, right=(1, 2)))
    out.print(f"\nMeasured for this failure: goodput {r.gain:+.1f} percentage points with two tiers, checkpoint cost")
    out.print(
        f"{_cost(one):.2f} s -> {_cost(two):.2f} s. With one failure in a short run, the restart (the same work in"
    )
    out.print("both: process start to model built) and run-to-run noise (other) can outweigh the checkpoints;")
    out.print("the model below weighs the measured costs over a long run.\n")
    for line in _model_lines(r):
        out.print(line)
    out.print(f"\nLogs: {r.logs}")
