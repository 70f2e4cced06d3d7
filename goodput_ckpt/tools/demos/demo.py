"""``goodput-ckpt demo``: kill a real training job, resume it, prove nothing changed, count the cost.

The demo runs a small 2-rank job (FSDP2 MLP with dropout, a shuffling ``StatefulDataLoader``
with 2 workers, AdamW, a LambdaLR schedule; :mod:`._demo_job`) three ways:

1. the **reference** run: the whole job with no checkpointing and no failure;
2. the **checkpointed** run under :class:`~goodput_ckpt.CheckpointManager` (an async save every
   ``save_every`` steps). Partway through, the demo SIGKILLs every process of the job (ranks and
   their dataloader workers, each rank started in its own session);
3. the **restart**: the same command again. It restores the newest complete checkpoint and
   finishes the job.

It then checks that the resumed job ended bit for bit where the reference ended (blake3 digests
of the full parameters, optimizer and scheduler state, every rank's RNG states and the next
batches of every rank's dataloader), verifies every checkpoint left under the root, and accounts
for the wall time of the checkpointed run:

- ``total``: from the start of the first step to the end of the last, across the kill;
- ``training``: the useful work: the wall time of the same steps in the reference run;
- ``stall``: the time ``save`` blocked the loop, for the saves whose work was kept;
- ``lost``: from the end of the step the restored checkpoint holds until the kill;
- ``restart``: from the kill until the new processes were ready (process start, process group,
  model build; detection is instant here);
- ``restore``: from ready until the state was restored;
- ``other``: the rest: steps slowed by background writes (on a CPU-only machine training and
  writing share the cores), and run-to-run noise.

Goodput = training / total. The same run with synchronous checkpoints would have stalled, at
every save whose work was kept, for a blocking ``dcp.save`` with torch's stock
``FileSystemWriter`` (timed once at the end of the run, to local disk: the ``sync`` probe)
instead of our stall, with the same lost work, restart and restore. The unexplained ``other``
time is charged to both (:data:`SYNC_BASIS`):
``goodput_sync = training / (total - stall + saves × sync)``.

Why: ``other`` is mostly machine noise, which a synchronous run suffers as much; charged to
ours alone, the comparison followed the load (58.5 % against a synchronous 63.5 % on a busy
machine). Now the two differ by ``saves × (sync - stall)`` only, whatever the load; our
background writes' share of ``other`` is charged to both, which flatters us by that much.

Rank 0's event lines and the time split live in :mod:`._trace`. The two-tier demo
(:mod:`.demo_tiers`) runs the same steps (through :func:`_kill_and_restart` and
:func:`._trace.account`) once with one tier and once with two, for the same failure.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._job_launch import JobLaunch, free_port
from ._trace import Trace, account, in_flight_at_kill, parse_line, span
from .results import SYNC_BASIS, DemoReport

__all__ = ["SYNC_BASIS", "DemoConfig", "DemoReport", "run_demo"]

#: A file that marks a directory as the demo's own, so a rerun may clear it.
MARKER = ".goodput-demo"

#: The two-tier demo's failures: a lost node (killed, its local directory deleted), or the job
#: killed with every node's local directory intact.
FAILURES = ("node", "job")

#: ``on_event(kind, text)``: ``kind`` is ``"phase"`` (a new phase starts), ``"step"`` (progress
#: within a phase) or ``"note"`` (something worth a line).
EventCallback = Callable[[str, str], None]


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """What the demo runs.

    Attributes:
        workdir: a local directory for logs, fingerprints and (by default) the checkpoints. It is
            created, or cleared when a previous demo made it; any other non-empty directory is
            refused.
        uri: the checkpoint root (default ``WORKDIR/checkpoints``): a local path, ``s3://...``
            or a path on a mounted volume.
        storage_options: backend options for ``uri`` (for example ``endpoint_url``).
        steps, save_every, width: the job's length, checkpoint interval and model width
            (``width``² × 4 layers parameters, about 16 MB of fp32 weights at 1024).
        kill_at: the step after which the job is killed (default: a save step 40-70% through
            the run, chosen with ``seed``: the kill lands while that save is written in the
            background, so the restart goes back to the save before).
        seed: seeds the kill point.
        timeout_s: the longest any launch may run.
        persist_every, failure, node_mtbf, job_mtbf: the two-tier demo's (:mod:`.demo_tiers`):
            every how many local saves one is persisted; the failure (``"node"``: the job is
            killed and the last node's local directory deleted; ``"job"``: only killed); and the
            failure rates (seconds) the two-level model's prediction assumes.
    """

    workdir: str = "goodput-demo"
    uri: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    steps: int = 120
    save_every: int = 20
    width: int = 1024
    world_size: int = 2
    kill_at: int | None = None
    seed: int = 0
    timeout_s: float = 600.0
    persist_every: int = 3
    failure: str = "node"
    node_mtbf: float = 4 * 3600.0
    job_mtbf: float = 3 * 86400.0

    def __post_init__(self) -> None:
        for name in ("steps", "save_every", "width", "world_size", "persist_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.steps < 2 * self.save_every + 2:
            raise ValueError(
                f"steps ({self.steps}) must be at least 2 × save_every + 2 so a checkpoint exists before the kill"
            )
        if self.width % 2:
            raise ValueError(f"width must be even, got {self.width}")
        if self.kill_at is not None and not self.save_every <= self.kill_at < self.steps - 1:
            raise ValueError(
                f"kill_at must be in [save_every, steps - 1) = [{self.save_every}, {self.steps - 1}), got {self.kill_at}"
            )
        if self.failure not in FAILURES:
            raise ValueError(f"failure must be one of {', '.join(FAILURES)}, got {self.failure!r}")
        for name in ("node_mtbf", "job_mtbf"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")

    @property
    def root(self) -> str:
        return self.uri if self.uri is not None else os.path.join(self.workdir, "checkpoints")


def _launch(
    cfg: DemoConfig,
    tag: str,
    out: str,
    logs: str,
    *,
    root: str | None,
    timeline: str = "",
    options: dict[str, Any] | None = None,
    sync_probe: bool = True,
) -> JobLaunch:
    """Start the demo job once, every rank on a fresh port. ``root=None``: the reference run (no
    manager); else a managed run whose ``CheckpointManager`` gets ``cfg.storage_options`` and
    ``options`` as keyword arguments."""
    os.makedirs(out, exist_ok=True)
    port = free_port()
    commands = []
    for rank in range(cfg.world_size):
        cmd = [
            sys.executable,
            "-m",
            "goodput_ckpt.tools.demos._demo_job",
            "--rank",
            str(rank),
            "--world-size",
            str(cfg.world_size),
            "--port",
            str(port),
            "--out",
            out,
            "--steps",
            str(cfg.steps),
            "--width",
            str(cfg.width),
        ]
        if root is not None:
            cmd += ["--root", root, "--save-every", str(cfg.save_every), "--timeline", timeline]
            cmd += ["--sync-probe"] if sync_probe else []
            for k, v in {**cfg.storage_options, **(options or {})}.items():
                cmd += ["-o", f"{k}={json.dumps(v)}"]
        commands.append(cmd)
    return JobLaunch(commands, logs, tag)


def _run_launch(
    launch: JobLaunch, cfg: DemoConfig, emit: EventCallback, *, kill_after: int | None = None
) -> tuple[Trace, float | None]:
    """Follow a launch to its end, or SIGKILL it once ``kill_after`` was printed."""
    trace, deadline, shown = Trace(), time.monotonic() + cfg.timeout_s, -1
    try:
        while True:
            line = launch.next_line(deadline)
            if line is None:
                break
            try:
                parse_line(trace, line)
            except (ValueError, IndexError):
                continue  # not one of ours (a library printed something)
            if line.startswith("STEP"):
                step = int(line.split()[1])
                if step * 10 // cfg.steps != shown * 10 // cfg.steps or step == cfg.steps - 1:
                    emit("step", f"step {step + 1}/{cfg.steps}")
                shown = step
                if kill_after is not None and step == kill_after:
                    return trace, launch.kill()
            elif line.startswith("SAVED"):
                emit("note", f"  save of step {line.split()[1]} handed to the background")
            elif line.startswith("RESTORED"):
                emit("note", f"  restored: {'nothing yet' if trace.restored is None else f'step {trace.restored}'}")
        launch.finish(deadline)
    except BaseException:
        launch.kill()
        raise
    return trace, None


def _prepare(workdir: str) -> None:
    if os.path.isdir(workdir) and os.listdir(workdir):
        if not os.path.exists(os.path.join(workdir, MARKER)):
            raise ValueError(f"{workdir} exists and was not made by goodput-ckpt demo; choose another --dir")
        shutil.rmtree(workdir)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, MARKER), "w") as f:
        f.write("made by goodput-ckpt demo; a rerun clears this directory\n")


def _compare(a_dir: str, b_dir: str, world_size: int) -> tuple[int, list[str]]:
    compared, mismatches = 0, []
    for rank in range(world_size):
        with open(os.path.join(a_dir, f"fingerprint-rank{rank}.json")) as f:
            want = json.load(f)
        with open(os.path.join(b_dir, f"fingerprint-rank{rank}.json")) as f:
            got = json.load(f)
        for key in sorted(set(want) | set(got)):
            compared += 1
            if want.get(key) != got.get(key):
                mismatches.append(f"rank {rank}: {key}")
    return compared, mismatches


def _kill_point(cfg: DemoConfig) -> int:
    """A save step 40-70% through the run (the one after 40% when none is in that window)."""
    if cfg.kill_at is not None:
        return cfg.kill_at
    lo, hi = int(cfg.steps * 0.4), int(cfg.steps * 0.7)
    options = [s for s in range(lo, hi + 1) if s % cfg.save_every == 0]
    return random.Random(cfg.seed).choice(options or [lo + (-lo) % cfg.save_every])


def _start(cfg: DemoConfig) -> tuple[DemoConfig, str, str]:
    """Check the URI, make the work directory: the config with an absolute ``workdir``, the
    log directory and the device the ranks train on."""
    from ...storage import open_store
    from ._demo_job import device_for

    if cfg.uri is not None:
        open_store(cfg.uri, cfg.storage_options)  # a bad URI or option fails before any job starts
    cfg = DemoConfig(**{**cfg.__dict__, "workdir": os.path.abspath(cfg.workdir)})
    _prepare(cfg.workdir)
    logs = os.path.join(cfg.workdir, "logs")
    os.makedirs(logs)
    return cfg, logs, str(device_for(0, cfg.world_size))


def _reference(cfg: DemoConfig, logs: str, device: str, emit: EventCallback) -> tuple[Trace, str]:
    """The uninterrupted run without checkpoints: its trace and fingerprint directory."""
    emit("phase", f"reference run: {cfg.steps} steps, {cfg.world_size} ranks on {device}, no checkpoints")
    ref_dir = os.path.join(cfg.workdir, "reference")
    ref, _ = _run_launch(_launch(cfg, "reference", ref_dir, logs, root=None), cfg, emit)
    return ref, ref_dir


def _kill_and_restart(
    cfg: DemoConfig,
    tag: str,
    run_dir: str,
    logs: str,
    emit: EventCallback,
    *,
    root: str,
    timeline: str,
    options: dict[str, Any] | None = None,
    sync_probe: bool = True,
    after_kill: Callable[[], None] | None = None,
) -> tuple[Trace, Trace, float]:
    """The checkpointed run SIGKILLed after the kill point, ``after_kill()`` (what else the failure
    took), and its restart: both launches' traces and the time of the kill."""
    kill_after = _kill_point(cfg)
    first, killed_at = _run_launch(
        _launch(
            cfg, f"{tag}launch1", run_dir, logs, root=root, timeline=timeline, options=options, sync_probe=sync_probe
        ),
        cfg,
        emit,
        kill_after=kill_after,
    )
    assert killed_at is not None
    emit("note", f"  SIGKILL of every process of the job after step {kill_after}")
    if after_kill is not None:
        after_kill()
    emit("phase", "restart: the same command again")
    second, _ = _run_launch(
        _launch(
            cfg, f"{tag}launch2", run_dir, logs, root=root, timeline=timeline, options=options, sync_probe=sync_probe
        ),
        cfg,
        emit,
    )
    return first, second, killed_at


def _verify_steps(root: str, storage_options: dict[str, Any], **labels: Any) -> list[dict[str, Any]]:
    """Verify every complete step under ``root``: one row per step (``labels`` added to each)."""
    from ...manager.retention import scan_steps
    from ...manager.step_layout import child_uri, step_dir_name
    from ...storage import open_store
    from ..ops.verify import verify_checkpoint

    rows = []
    for step in scan_steps(open_store(root, storage_options)).complete:
        v = verify_checkpoint(child_uri(root, step_dir_name(step)), **storage_options)
        rows.append({"step": step, **labels, "ok": v.ok, "status": v.status, "bytes": v.bytes_hashed, "gbps": v.gbps})
    return rows


def run_demo(cfg: DemoConfig, on_event: EventCallback | None = None) -> DemoReport:
    """Run the demo (see the module docstring) and return its report.

    Raises:
        ValueError: a bad configuration or a work directory that is not the demo's.
        RuntimeError: a launch failed (the message ends with its stderr).
    """
    emit = on_event or (lambda kind, text: None)
    cfg, logs, device = _start(cfg)
    timeline = os.path.join(cfg.workdir, "timeline.jsonl")
    ref, ref_dir = _reference(cfg, logs, device, emit)

    run_dir = os.path.join(cfg.workdir, "resumed")
    kill_after = _kill_point(cfg)
    emit(
        "phase",
        f"checkpointed run: async save every {cfg.save_every} steps to {cfg.root}; SIGKILL after step {kill_after}",
    )
    first, second, killed_at = _kill_and_restart(cfg, "", run_dir, logs, emit, root=cfg.root, timeline=timeline)

    emit("phase", "checking the resumed run against the reference, and verifying every checkpoint")
    compared, mismatches = _compare(ref_dir, run_dir, cfg.world_size)
    checkpoints = _verify_steps(cfg.root, cfg.storage_options)
    acc = account(ref, first, second, killed_at)
    return DemoReport(
        root=cfg.root,
        device=device,
        steps=cfg.steps,
        save_every=cfg.save_every,
        world_size=cfg.world_size,
        killed_after_step=kill_after,
        save_in_flight_at_kill=in_flight_at_kill(first, timeline, killed_at),
        restored_step=second.restored,
        bit_exact=not mismatches and compared > 0,
        values_compared=compared,
        mismatches=mismatches,
        checkpoints=checkpoints,
        reference_s=span(ref),
        logs=logs,
        **acc,
    )
