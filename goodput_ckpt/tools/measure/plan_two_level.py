"""The two-level goodput model: how often to save to the node-local tier, and every how many
local saves to also persist.

Why a second model: with a node-local tier (``CheckpointManager(local_dir=..., replicas=1,
persist_every=k)``) most failures (a lost node, whose shards survive on a replica) restore from
fast local copies, and only rarer catastrophic ones (a node lost together with its replica
partner, the whole job, the cluster's storage) need the persistent tier. One interval no longer
describes the schedule: there is a local interval ``τ`` and a persistence period ``k``.

Inputs (seconds):

- ``local_stall`` (``δ_L``): time training blocks per local save;
- ``replicate`` (``W_L``): time from the end of that stall until the local copy and its replica
  are complete; a node failure during it falls back one local save;
- ``persist_stall`` (``δ_P``): extra stall of a save that also goes to the persistent tier
  (0 when, as in the manager, persistent copies are written from the local one in the background);
- ``persist`` (``W_P``): time from that stall until the persistent copy is durable;
- ``local_restore`` and ``restore``: time to load a checkpoint from the local tier (or a replica)
  and from the persistent tier; ``restart``: time to detect a failure and restart the job;
- ``node_mtbf`` (``M_L``): mean time between failures the local tier survives (``math.inf``: none);
- ``job_mtbf`` (``M_P``): mean time between failures that need the persistent tier.

A pattern is ``k`` local saves, the ``k``-th of which is also persisted; it lasts
``T = k(τ + δ_L) + δ_P`` and holds ``kτ`` of training. A node failure costs the restart, the
local restore and the work since the last complete local save, on average ``T/(2k) + W_L``; a
catastrophic one costs the restart, the persistent restore and on average ``T/2 + W_P``. To first
order in ``1/M`` the expected goodput is::

    G(τ, k) = kτ/T · (1 − (R_L + T/(2k) + W_L)/M_L − (R_P + T/2 + W_P)/M_P)

with ``R_L = restart + local_restore`` and ``R_P = restart + restore``. With ``k = 1`` and no node
failures it is the one-level model of :mod:`goodput_ckpt.tools.measure.plan`. Writing ``C = kδ_L + δ_P``
(the stall per pattern), ``A = (R_L + W_L)/M_L + (R_P + W_P)/M_P`` and
``B = 1/(2k M_L) + 1/(2 M_P)``, it is ``G = (1 − C/T)(1 − A − BT)``, whose maximum over ``T`` is at::

    T*(k) = sqrt(C (1 − A) / B),    G*(k) = (sqrt(1 − A) − sqrt(B C))²

For ``A → 0`` this is the first-order optimal period of a multi-level pattern,
``sqrt(Σ n_ℓ C_ℓ / Σ (λ_ℓ / 2n_ℓ))`` with ``n_L = k`` local and ``n_P = 1`` persistent
checkpoints (A. Benoit, A. Cavelan, V. Le Fèvre, Y. Robert, H. Sun, "Towards Optimal Multi-Level
Checkpointing", IEEE Transactions on Computers 66(7), 2017), and the continuous optimum of ``k``,
``sqrt(δ_P M_P / (δ_L M_L))``, is the two-level ratio of S. Di, Y. Robert, F. Vivien,
F. Cappello, "Toward an Optimal Online Checkpoint Solution under a Two-Level HPC Checkpoint
Model", IEEE TPDS 28(1), 2017. With ``k = 1`` and ``A = 0`` it is Young's ``sqrt(2δM)``.

Bandwidth bounds the schedule, as it does in practice: a replica must be complete before the next
local save (``τ + δ_L ≥ W_L``) and a persistent upload before the next persistent save
(``T ≥ W_P``). Without the second bound a free persistent stall (``δ_P = 0``) would make ``k = 1``
optimal whatever the upload costs. :func:`plan_two_level` takes, for every ``k`` from 1 to
``max_persist_every``, the best ``T`` within the bounds (``G`` is unimodal in ``T``, so it is
``T*(k)`` or the nearest bound) and keeps the ``k`` with the highest goodput: bounded work, no
iteration to converge.

For comparison it plans the same job on one tier (:func:`goodput_ckpt.tools.measure.plan.plan`, Daly's
interval): every save goes to the persistent tier with the stall ``δ_L + δ_P`` and upload ``W_P``,
and every failure (rate ``1/M_L + 1/M_P``) restores from it. That plan ignores the upload bound,
so the gain it shows is, if anything, understated.

Valid while the costs and intervals are small next to the MTBFs. First order, a failure that
strikes during a restart or during work already lost counts as if it struck useful time, so the
model is slightly pessimistic (``tests/tools/measure/test_plan_two_level.py`` simulates it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .plan import MIN_INTERVAL, GoodputPlan, PlanInputs, plan

__all__ = [
    "TwoLevelInputs",
    "TwoLevelOption",
    "TwoLevelPlan",
    "one_level_inputs",
    "plan_two_level",
    "two_level_goodput",
]


@dataclass(frozen=True, kw_only=True)
class TwoLevelInputs:
    """Inputs of the two-level model; see the module docstring. All times in seconds."""

    local_stall: float
    node_mtbf: float
    job_mtbf: float
    replicate: float = 0.0
    local_restore: float = 0.0
    persist_stall: float = 0.0
    persist: float = 0.0
    restore: float = 0.0
    restart: float = 0.0
    #: The largest ``persist_every`` searched (the search is one closed form per value).
    max_persist_every: int = 10_000

    def __post_init__(self) -> None:
        for name in ("local_stall", "replicate", "local_restore", "persist_stall", "persist", "restore", "restart"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 seconds, got {v!r}")
        nm = self.node_mtbf
        if not (isinstance(nm, (int, float)) and not math.isnan(nm) and nm > 0):
            raise ValueError(f"node_mtbf must be a positive number of seconds (inf: no node failures), got {nm!r}")
        jm = self.job_mtbf
        if not (isinstance(jm, (int, float)) and math.isfinite(jm) and jm > 0):
            raise ValueError(f"job_mtbf must be a positive number of seconds, got {jm!r}")
        k = self.max_persist_every
        if not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 1_000_000):
            raise ValueError(f"max_persist_every must be an integer from 1 to 1000000, got {k!r}")

    @property
    def failure_rate(self) -> float:
        """All failures per second, local and catastrophic (``1/M_L + 1/M_P``)."""
        return 1.0 / self.node_mtbf + 1.0 / self.job_mtbf


@dataclass(frozen=True)
class TwoLevelOption:
    """The best local interval for one ``persist_every``, and what it gives."""

    persist_every: int
    local_interval: float
    persistent_period: float
    goodput: float
    #: what set the interval: ``optimum`` (``T*``), ``replication`` (``τ + δ_L ≥ W_L``),
    #: ``persistent upload`` (``T ≥ W_P``) or ``minimum interval``.
    bound: str


@dataclass(frozen=True)
class TwoLevelPlan:
    """The two-level model's answer. Goodputs are fractions in [0, 1]; intervals in seconds.

    Attributes:
        local_interval: seconds of training between local saves (``τ``).
        persist_every: every how many local saves one is also persisted (``k``, ≥ 1).
        persistent_period: wall seconds between persistent saves (``T``).
        goodput: expected goodput of that schedule.
        bound: what set the interval (see :class:`TwoLevelOption`).
        one_level: the best plan with the persistent tier only, for comparison.
        gain: ``goodput − one_level.goodput_at_optimum``, in percentage points.
        options: the best schedule for a few other ``persist_every`` (1, ``k ± 1`` and ``2k``).
    """

    inputs: TwoLevelInputs
    local_interval: float
    persist_every: int
    persistent_period: float
    goodput: float
    bound: str
    one_level: GoodputPlan
    gain: float
    options: list[TwoLevelOption] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def two_level_goodput(local_interval: float, persist_every: int, p: TwoLevelInputs) -> float:
    """Expected goodput ``G(τ, k)`` (module docstring), clipped to [0, 1]; bounds not checked."""
    if not local_interval > 0:
        raise ValueError(f"local_interval must be positive, got {local_interval!r}")
    if not (isinstance(persist_every, int) and persist_every >= 1):
        raise ValueError(f"persist_every must be an integer >= 1, got {persist_every!r}")
    k = persist_every
    period = k * (local_interval + p.local_stall) + p.persist_stall
    node_loss = (p.restart + p.local_restore + period / (2 * k) + p.replicate) / p.node_mtbf
    job_loss = (p.restart + p.restore + period / 2 + p.persist) / p.job_mtbf
    g = k * local_interval / period * (1.0 - node_loss - job_loss)
    return min(1.0, max(0.0, g))


def _best_for(k: int, p: TwoLevelInputs) -> TwoLevelOption:
    """The best pattern period for ``k`` within the bounds: ``T*(k)`` or the bound it crosses."""
    stall = k * p.local_stall + p.persist_stall
    a = (p.restart + p.local_restore + p.replicate) / p.node_mtbf + (p.restart + p.restore + p.persist) / p.job_mtbf
    b = 1.0 / (2 * k * p.node_mtbf) + 1.0 / (2 * p.job_mtbf)
    period, bound = (math.sqrt(stall * (1.0 - a) / b), "optimum") if a < 1 else (0.0, "optimum")
    floors = (
        (k * (p.local_stall + MIN_INTERVAL) + p.persist_stall, "minimum interval"),
        (k * max(p.replicate, p.local_stall + MIN_INTERVAL) + p.persist_stall, "replication"),
        (p.persist, "persistent upload"),
    )
    for floor, name in floors:
        if floor > period:
            period, bound = floor, name
    tau = (period - p.persist_stall) / k - p.local_stall
    return TwoLevelOption(k, tau, period, two_level_goodput(tau, k, p), bound)


def one_level_inputs(p: TwoLevelInputs) -> PlanInputs:
    """The same job on the persistent tier alone: every save persisted, every failure restored
    from it (see the module docstring)."""
    return PlanInputs(
        stall=p.local_stall + p.persist_stall,
        persist=p.persist,
        restore=p.restore,
        restart=p.restart,
        mtbf=1.0 / p.failure_rate,
    )


def plan_two_level(p: TwoLevelInputs) -> TwoLevelPlan:
    """The local interval and ``persist_every`` that maximize goodput, and the one-level plan.

    Ties go to the smaller ``persist_every`` (fewer local copies to keep per persistent one).
    """
    best = _best_for(1, p)
    by_k = {1: best}
    for k in range(2, p.max_persist_every + 1):
        option = _best_for(k, p)
        if option.goodput > best.goodput + 1e-12:
            best = option
    k = best.persist_every
    for other in (k - 1, k + 1, 2 * k):
        if 1 <= other <= p.max_persist_every and other not in by_k:
            by_k[other] = _best_for(other, p)
    by_k.pop(k, None)
    one = plan(one_level_inputs(p))
    return TwoLevelPlan(
        inputs=p,
        local_interval=best.local_interval,
        persist_every=k,
        persistent_period=best.persistent_period,
        goodput=best.goodput,
        bound=best.bound,
        one_level=one,
        gain=round(100.0 * (best.goodput - one.goodput_at_optimum), 6),
        options=[by_k[j] for j in sorted(by_k)],
    )
