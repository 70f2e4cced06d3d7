"""``goodput-ckpt demo --tiers``: the same job and the same failure, on one tier and on two.

The demo job (:mod:`._demo_job`) runs on ``world_size`` ranks laid out as 2 simulated nodes
(``local_world_size = world_size / 2``). After the reference run it runs twice more, each time
SIGKILLed after the same step, with the node-local files of the last node deleted before the
restart (a lost node), then restarted and compared bit for bit with the reference:

1. **one tier**: ``CheckpointManager(root)``, every save written to the persistent root. The lost
   node takes nothing with it; the restart reads the persistent tier.
2. **two tiers**: ``CheckpointManager(root, local_dir=WORKDIR/two-tier/local/node{node},
   local_world_size=..., replicas=1, persist_every=k)``: every save to the node-local tier with a
   replica on the other node, every ``k``-th save also to the persistent root in the background.
   The lost node's shards come back from their replica.

Both save every ``save_every`` steps, so they restore the same step unless the kill caught a save
in flight differently; the difference in goodput is the stall, the background load and the
restore. Each mode's wall time is split as in the one-tier demo (:func:`._trace.account`), and the
restore's tiers come from the restart's timeline records (``sources``).

The two-level model (:func:`goodput_ckpt.tools.measure.plan_two_level.plan_two_level`) then takes the
measured costs (stall, replication, persist, both restores, restart) with the assumed failure
rates ``node_mtbf`` (failures a replica survives) and ``job_mtbf`` and predicts the best schedule
and the goodput of each tier layout over a long run, where one failure in a short demo cannot.
"""

from __future__ import annotations

import os
import shutil
import statistics
from typing import Any

from ..measure.plan_two_level import TwoLevelInputs, TwoLevelPlan, plan_two_level
from ._trace import account, in_flight_at_kill, span
from .demo import (
    DemoConfig,
    EventCallback,
    _compare,
    _kill_and_restart,
    _kill_point,
    _reference,
    _start,
    _verify_steps,
)
from .results import DemoMode, TierDemoReport

__all__ = ["DemoMode", "TierDemoReport", "run_tier_demo"]

#: The simulated nodes of the two-tier demo: the fewest that let a replica survive a lost node.
NODES = 2
#: The tier names in the order a restore tries them (as the manager's restore records name them).
TIER_ORDER = ("local", "replica", "persistent")


def _check_layout(cfg: DemoConfig) -> None:
    if cfg.world_size % NODES:
        raise ValueError(
            f"the two-tier demo lays the ranks out as {NODES} nodes: the world size must be even, got {cfg.world_size}"
        )


def _child(cfg: DemoConfig, name: str) -> str:
    """The persistent root of one mode: under ``--uri`` when given, else in the work directory."""
    from ...manager.step_layout import child_uri

    if cfg.uri is None:
        return os.path.join(cfg.workdir, name, "checkpoints")
    return child_uri(cfg.uri, name)


def _restart_records(timeline: str, killed_at: float) -> list[dict[str, Any]]:
    from ...manager.timeline import read_timeline

    return [r for r in read_timeline(timeline) if r.get("time", 0.0) >= killed_at]


def _sources(records: list[dict[str, Any]]) -> dict[str, int]:
    """Data files the restart's restore read per tier, summed over the ranks."""
    files: dict[str, int] = {}
    for r in records:
        if r["event"] == "restore" and r.get("ok"):
            for tier, n in (r.get("sources") or {}).items():
                files[tier] = files.get(tier, 0) + int(n)
    return {t: files[t] for t in sorted(files, key=lambda t: (TIER_ORDER + (t,)).index(t))}


def _median_per_step(records: list[dict[str, Any]], event: str, key: str) -> float | None:
    """The median over steps of the slowest rank's ``key`` among successful ``event`` records."""
    per_step: dict[int, float] = {}
    for r in records:
        if r.get("event") == event and r.get("ok") and r.get(key) is not None:
            per_step[r["step"]] = max(per_step.get(r["step"], 0.0), float(r[key]))
    return statistics.median(per_step.values()) if per_step else None


def _run_mode(
    cfg: DemoConfig, name: str, logs: str, ref: Any, ref_dir: str, emit: EventCallback, *, two_tiers: bool
) -> DemoMode:
    from ...manager.job import local_job_dir, read_job_file
    from ...manager.timeline import read_timeline
    from ...storage import open_store

    slug = name.replace(" ", "-")
    base = os.path.join(cfg.workdir, slug)
    root, timeline, run_dir = _child(cfg, slug), os.path.join(base, "timeline.jsonl"), os.path.join(base, "resumed")
    os.makedirs(base, exist_ok=True)
    local_dir, options, lost_dir = None, {}, None
    lost = NODES - 1 if cfg.failure == "node" else None
    if two_tiers:
        local_dir = os.path.join(base, "local", "node{node}")
        lost_dir = None if lost is None else local_dir.format(node=lost)
        options = {
            "local_dir": local_dir,
            "local_world_size": cfg.world_size // NODES,
            "replicas": 1,
            "persist_every": cfg.persist_every,
        }
        how = f"every save to node-local disk with a replica on the other node, 1 save in {cfg.persist_every} also to {root}"
    else:
        how = f"every save to {root}"
    failure = f"SIGKILL after step {_kill_point(cfg)}" + ("" if lost is None else f", node {lost} lost")
    emit("phase", f"{name}: async save every {cfg.save_every} steps, {how}; {failure}")

    def lose_node() -> None:
        if lost_dir is not None:
            shutil.rmtree(lost_dir, ignore_errors=True)
            emit("note", f"  node {lost}'s local directory deleted: {lost_dir}")
        elif lost is not None:
            emit("note", f"  node {lost} lost: it held nothing the restart needs (every save is persistent)")

    first, second, killed_at = _kill_and_restart(
        cfg,
        f"{slug}-",
        run_dir,
        logs,
        emit,
        root=root,
        timeline=timeline,
        options=options,
        sync_probe=False,
        after_kill=lose_node,
    )
    emit("phase", f"{name}: checking the resumed run against the reference, and verifying every checkpoint")
    compared, mismatches = _compare(ref_dir, run_dir, cfg.world_size)
    checkpoints = _verify_steps(root, cfg.storage_options, tier="persistent")
    if local_dir is not None:
        job_id = read_job_file(open_store(root, cfg.storage_options))  # each job's local steps lie in its own directory
        for node in range(NODES):
            checkpoints += _verify_steps(
                local_job_dir(local_dir.format(node=node), job_id), {}, tier=f"local node {node}"
            )
    acc = account(ref, first, second, killed_at)
    records = read_timeline(timeline)
    files = _sources(_restart_records(timeline, killed_at)) if two_tiers else {}
    return DemoMode(
        name=name,
        root=root,
        local_dir=local_dir,
        persist_every=cfg.persist_every if two_tiers else None,
        save_in_flight_at_kill=in_flight_at_kill(first, timeline, killed_at),
        restored_step=second.restored,
        restored_from=list(files) if two_tiers else ["persistent"],
        restore_files=files,
        bit_exact=not mismatches and compared > 0,
        values_compared=compared,
        mismatches=mismatches,
        checkpoints=checkpoints,
        seconds=acc["seconds"],
        goodput=acc["goodput"],
        saves_kept=acc["saves_kept"],
        stall_per_save_s=acc["stall_per_save_s"],
        background_per_save_s=_median_per_step(records, "save", "durable_s"),
        persist_per_save_s=_median_per_step(records, "persist", "seconds") if two_tiers else None,
    )


def _model(cfg: DemoConfig, one: DemoMode, two: DemoMode) -> TwoLevelPlan | None:
    """The two-level plan for the measured costs (see the module docstring), or ``None`` when
    the run measured no persist or background time."""
    persist = two.persist_per_save_s if two.persist_per_save_s is not None else one.background_per_save_s
    if persist is None or two.background_per_save_s is None:
        return None
    inputs = TwoLevelInputs(
        local_stall=two.stall_per_save_s,
        replicate=two.background_per_save_s,
        local_restore=two.seconds["restore"],
        persist_stall=0.0,
        persist=persist,
        restore=one.seconds["restore"],
        restart=(one.seconds["restart"] + two.seconds["restart"]) / 2,
        node_mtbf=cfg.node_mtbf,
        job_mtbf=cfg.job_mtbf,
    )
    return plan_two_level(inputs)


def run_tier_demo(cfg: DemoConfig, on_event: EventCallback | None = None) -> TierDemoReport:
    """Run the two-tier demo (see the module docstring) and return its report.

    Raises:
        ValueError: a bad configuration (an odd world size) or a work directory that is not the demo's.
        RuntimeError: a launch failed (the message ends with its stderr).
    """
    _check_layout(cfg)
    emit = on_event or (lambda kind, text: None)
    cfg, logs, device = _start(cfg)
    ref, ref_dir = _reference(cfg, logs, device, emit)
    one = _run_mode(cfg, "one tier", logs, ref, ref_dir, emit, two_tiers=False)
    two = _run_mode(cfg, "two tiers", logs, ref, ref_dir, emit, two_tiers=True)
    return TierDemoReport(
        device=device,
        steps=cfg.steps,
        save_every=cfg.save_every,
        world_size=cfg.world_size,
        nodes=NODES,
        local_world_size=cfg.world_size // NODES,
        killed_after_step=_kill_point(cfg),
        lost_node=NODES - 1 if cfg.failure == "node" else None,
        reference_s=span(ref),
        modes=[one, two],
        gain=100 * (two.goodput - one.goodput),
        node_mtbf=cfg.node_mtbf,
        job_mtbf=cfg.job_mtbf,
        model=_model(cfg, one, two),
        logs=logs,
    )
