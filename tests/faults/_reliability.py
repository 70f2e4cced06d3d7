"""What the reliability suite records, and how many trials it runs.

Each scenario of ``tests/faults`` appends one JSON line per (scenario, backend) to the file named
by ``GOODPUT_RELIABILITY_LOG`` when it is set (``benchmarks/reliability_report.py`` sets it and
prints the table). Fields:

- ``scenario``, ``backend``: what was tried, where;
- ``trials``: how many times;
- ``faults_injected``: how many trials really hit a fault (a SIGKILL that landed before the
  save finished, a flipped bit, an injected HTTP error ...);
- ``detected_or_recovered``: trials whose fault was detected (a clean, named error) or recovered
  from (retried to success, the latest complete checkpoint restored);
- ``data_lost``: trials that lost or silently damaged committed data, or returned wrong values
  (must be 0; the test fails when it is not, after writing the line);
- ``details``: free-form (phases hit, error kinds ...).

``GOODPUT_FAULT_TRIALS`` scales the randomized scenarios: their trial counts are
``fault_trials(default)``. ``reliability_report.py --long`` raises it.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["TRIALS_ENV", "LOG_ENV", "fault_trials", "record"]

TRIALS_ENV = "GOODPUT_FAULT_TRIALS"
LOG_ENV = "GOODPUT_RELIABILITY_LOG"


def fault_trials(default: int) -> int:
    """Trials of a randomized scenario: ``default``, scaled by ``GOODPUT_FAULT_TRIALS / 30``
    when the variable is set (30 is the suite's default count per backend)."""
    raw = os.environ.get(TRIALS_ENV)
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{TRIALS_ENV} must be a positive integer, got {raw!r}") from None
    if n < 1:
        raise ValueError(f"{TRIALS_ENV} must be a positive integer, got {raw!r}")
    return max(1, round(default * n / 30))


def record(
    scenario: str,
    backend: str,
    *,
    trials: int,
    faults_injected: int,
    detected_or_recovered: int,
    data_lost: int,
    **details: Any,
) -> None:
    """Append one result line (see the module docstring); a no-op without ``GOODPUT_RELIABILITY_LOG``."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    line = json.dumps(
        {
            "scenario": scenario,
            "backend": backend,
            "trials": trials,
            "faults_injected": faults_injected,
            "detected_or_recovered": detected_or_recovered,
            "data_lost": data_lost,
            "details": details,
        },
        sort_keys=False,
        default=str,
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
