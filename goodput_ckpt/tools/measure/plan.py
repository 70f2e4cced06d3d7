"""The goodput model: how often to checkpoint, and what it buys.

Inputs (seconds unless noted):

- ``stall``: time training is blocked per checkpoint (``δ``);
- ``persist``: time a background save takes to become durable after the stall (``W``);
  a failure during it falls back to the previous checkpoint;
- ``restore``: time to load the latest checkpoint after a restart;
- ``restart``: time to detect a failure and restart the job (scheduling, process start);
- ``mtbf``: mean time between failures of the whole job (``M``); given directly, or as
  ``1 / (gpus × failures per GPU-hour)``.

With a checkpoint every ``τ`` seconds of training, a cycle lasts ``τ + δ``. A failure costs the
restart and restore time ``R = restart + restore`` plus the work since the last *durable*
checkpoint, on average ``(τ + δ)/2 + W``. To first order in ``1/M`` the expected goodput is::

    G(τ) = τ / (τ + δ) × (1 − (R + (τ + δ)/2 + W) / M)

clipped to [0, 1]. Ignoring second-order terms, maximizing it gives Young's interval
``τ_Y = sqrt(2 δ M)``; Daly's higher-order estimate, which this module reports as the optimum, is::

    τ* = sqrt(2 δ M) × (1 + sqrt(δ / (2M)) / 3 + (δ / (2M)) / 9) − δ     if δ < 2M
    τ* = M                                                             otherwise

(J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
FGCS 22(3), 2006). The sensitivity of the goodput at ``τ*`` to each input is reported as the
change in goodput (in percentage points) when that input doubles, so inputs can be ranked by
what improving them is worth.

:func:`inputs_from_bench` takes ``stall``, ``persist`` and ``restore`` from the JSON report of
``goodput-ckpt bench`` (medians of its measurements on a synthetic state of the size it was run
with: bench with the size one node saves for the figures to apply). :func:`inputs_from_timeline`
takes them from a real run: the per-save timeline that ``CheckpointManager`` writes
(:mod:`goodput_ckpt.manager.timeline`), medians over its saves and restores, the slowest rank per step.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ._bench_report import BenchReport

__all__ = [
    "BenchMeasurement",
    "GoodputPlan",
    "PlanInputs",
    "goodput",
    "inputs_from_bench",
    "inputs_from_timeline",
    "mtbf_from_fleet",
    "optimal_interval",
    "plan",
]

#: The shortest interval recommended (seconds of training): a zero stall would otherwise ask for
#: continuous checkpointing.
MIN_INTERVAL = 1e-3


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """Inputs of the goodput model; see the module docstring. All times in seconds."""

    stall: float
    mtbf: float
    restore: float = 0.0
    restart: float = 0.0
    persist: float = 0.0
    current_interval: float | None = None

    def __post_init__(self) -> None:
        for name in ("stall", "restore", "restart", "persist"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 seconds, got {v!r}")
        if not (isinstance(self.mtbf, (int, float)) and math.isfinite(self.mtbf) and self.mtbf > 0):
            raise ValueError(f"mtbf must be a positive number of seconds, got {self.mtbf!r}")
        ci = self.current_interval
        if ci is not None and not (isinstance(ci, (int, float)) and math.isfinite(ci) and ci > 0):
            raise ValueError(f"current_interval must be a positive number of seconds, got {ci!r}")


@dataclass(frozen=True)
class GoodputPlan:
    """The model's answer. Goodputs are fractions in [0, 1]."""

    inputs: PlanInputs
    optimal_interval: float
    young_interval: float
    goodput_at_optimum: float
    current_interval: float | None
    goodput_at_current: float | None
    #: input name -> goodput change (percentage points) at the optimum when that input doubles.
    sensitivity: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BenchMeasurement:
    """The model's inputs measured by ``goodput-ckpt bench`` (seconds), and what was measured.

    Attributes:
        stall: median time ``dcp.async_save`` blocked the caller.
        persist: median time from the end of the stall until that save was durable.
        restore: median time ``dcp.load`` took to read the state back.
        method: the bench method the figures are from (``goodput`` or ``torch``).
        size_bytes, backend, uri: the state size and the storage the bench ran on.
    """

    stall: float
    persist: float
    restore: float
    method: str
    size_bytes: int
    backend: str
    uri: str

    def to_dict(self) -> dict:
        return asdict(self)


def inputs_from_bench(report: Mapping[str, Any] | str | os.PathLike, *, method: str = "goodput") -> BenchMeasurement:
    """``stall``, ``persist`` and ``restore`` from a ``goodput-ckpt bench --json`` report.

    Args:
        report: the report's JSON document, or the path of a file holding it.
        method: whose figures: ``goodput`` (this library) or ``torch`` (torch's writer).

    Raises:
        ValueError: the file cannot be read, is not a bench report, or lacks the method's figures.
    """
    if not isinstance(report, Mapping):
        try:
            with open(report, encoding="utf-8") as f:
                report = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the bench report {os.fspath(report)}: {e}") from e
    bench = BenchReport.from_json(report)
    try:
        m = bench.method(method)
    except KeyError:
        raise ValueError(f"the bench report has no method {method!r}") from None
    if not (m.available and m.stall_s and m.load_s and m.async_total_s):
        raise ValueError(f"the bench report has no figures for {method!r}: {m.reason or 'no samples'}")
    persist = statistics.median(max(0.0, t - s) for t, s in zip(m.async_total_s, m.stall_s))
    return BenchMeasurement(
        stall=m.median("stall_s"),
        persist=persist,
        restore=m.median("load_s"),
        method=method,
        size_bytes=bench.size_bytes,
        backend=bench.backend,
        uri=bench.uri,
    )


def inputs_from_timeline(path: str | os.PathLike) -> BenchMeasurement:
    """``stall``, ``persist`` and ``restore`` from a manager's timeline file.

    ``stall``: the median over saves of the slowest rank's stall; ``persist``: the median time
    from the hand-off to the background until durable (0 for synchronous saves, whose write is
    all stall); ``restore``: the median restore time (0 when the run never restored).

    Raises:
        ValueError: the file cannot be read, or it records no successful save.
    """
    from ...manager.timeline import read_timeline, summarize_timeline

    try:
        records = read_timeline(path)
    except OSError as e:
        raise ValueError(f"cannot read the timeline {os.fspath(path)}: {e}") from e
    summary = summarize_timeline(records)
    if not summary["saves"]:
        raise ValueError(f"the timeline {os.fspath(path)} records no successful save")
    persist = summary["durable_s"]["median"] if summary["async_saves"] else 0.0
    restore = summary["restore_s"]["median"] if summary["restore_s"] else 0.0
    return BenchMeasurement(
        stall=summary["stall_s"]["median"],
        persist=persist,
        restore=restore,
        method=f"median of {summary['saves']} saves",
        size_bytes=int(summary["bytes_per_save"]["median"]),
        backend="the run's storage",
        uri=os.fspath(path),
    )


def mtbf_from_fleet(gpus: int, failures_per_gpu_hour: float) -> float:
    """Job MTBF in seconds for ``gpus`` GPUs that each fail at the given hourly rate."""
    if not (isinstance(gpus, int) and gpus > 0):
        raise ValueError(f"gpus must be a positive integer, got {gpus!r}")
    if not (math.isfinite(failures_per_gpu_hour) and failures_per_gpu_hour > 0):
        raise ValueError(f"failures_per_gpu_hour must be positive, got {failures_per_gpu_hour!r}")
    return 3600.0 / (gpus * failures_per_gpu_hour)


def goodput(interval: float, p: PlanInputs) -> float:
    """Expected goodput ``G(τ)`` of checkpointing every ``interval`` seconds of training."""
    if interval <= 0:
        raise ValueError(f"interval must be positive, got {interval!r}")
    cycle = interval + p.stall
    lost_per_failure = p.restart + p.restore + cycle / 2 + p.persist
    g = interval / cycle * (1.0 - lost_per_failure / p.mtbf)
    return min(1.0, max(0.0, g))


def optimal_interval(stall: float, mtbf: float) -> float:
    """Daly's higher-order optimum interval (seconds); see the module docstring."""
    if stall <= 0:
        return 0.0  # free checkpoints: checkpoint continuously
    if stall >= 2 * mtbf:
        return mtbf
    x = stall / (2 * mtbf)
    return math.sqrt(2 * stall * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - stall


def plan(p: PlanInputs) -> GoodputPlan:
    """Optimum interval, goodput there and at the current interval, and sensitivities."""
    tau = max(optimal_interval(p.stall, p.mtbf), MIN_INTERVAL)
    g_opt = goodput(tau, p)
    sens: dict[str, float] = {}
    for name in ("stall", "persist", "restore", "restart", "mtbf"):
        base = getattr(p, name)
        if base == 0:
            sens[name] = 0.0
            continue
        changed = _replace(p, **{name: base * 2})
        tau2 = max(optimal_interval(changed.stall, changed.mtbf), MIN_INTERVAL)
        sens[name] = round(100.0 * (goodput(tau2, changed) - g_opt), 6)
    ci = p.current_interval
    return GoodputPlan(
        inputs=p,
        optimal_interval=tau,
        young_interval=math.sqrt(2 * p.stall * p.mtbf),
        goodput_at_optimum=g_opt,
        current_interval=ci,
        goodput_at_current=None if ci is None else goodput(ci, p),
        sensitivity=sens,
    )


def _replace(p: PlanInputs, **changes: float) -> PlanInputs:
    values = {k: getattr(p, k) for k in ("stall", "mtbf", "restore", "restart", "persist", "current_interval")}
    values.update(changes)
    return PlanInputs(**values)
