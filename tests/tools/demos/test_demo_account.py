"""The demo compares like with like (issue 35, item 6).

On a loaded machine the demo printed goodput 58.5 % for our run and 63.5 % "with synchronous
checkpoints for the same failure": the unexplained ``other`` time (11.8 %) was charged to our
run only. Now the synchronous estimate is the same run with each kept save's stall replaced by a
blocking save, everything else charged to both, and the report says how it was made. These
tests feed ``_trace.account`` the traces of one run at several machine loads (the ``other`` time).
"""

from __future__ import annotations

import pytest

from goodput_ckpt.tools.demos._trace import Trace, account
from goodput_ckpt.tools.demos.demo import SYNC_BASIS


def _traces(other: float, stall: float, sync: float) -> tuple[Trace, Trace, Trace, float]:
    """A reference of 100 steps of 0.1 s; a checkpointed run saving every 10 steps, killed
    after step 55 (restored from 50), whose steps are slowed by ``other`` seconds in all."""
    ref = Trace(steps={s: (0.1 * (s + 1), 0.1) for s in range(100)})
    slow = other / 100
    t, first = 0.0, Trace()
    for s in range(56):
        t += 0.1 + slow
        first.steps[s] = (t, 0.1 + slow)
        if s % 10 == 0 and s:
            t += stall
            first.saves[s] = (t, stall)
    killed = t + 0.05
    second = Trace(ready=killed + 2.0, restored=50, restored_at=killed + 2.5, sync_s=sync)
    t = killed + 2.5
    for s in range(51, 100):
        t += 0.1 + slow
        second.steps[s] = (t, 0.1 + slow)
        if s % 10 == 0:
            t += stall
            second.saves[s] = (t, stall)
    return ref, first, second, killed


@pytest.mark.parametrize("other", [0.0, 1.0, 5.0, 20.0])
def test_the_conclusion_does_not_flip_with_machine_load(other):
    acc = account(*_traces(other, stall=0.02, sync=0.3))
    assert acc["seconds"]["other"] == pytest.approx(other, abs=0.05)
    assert acc["goodput"] > acc["goodput_sync"]  # a 20 ms stall beats a 300 ms blocking save, at any load
    # The two totals differ by the saves alone: kept saves x (sync - stall).
    training = acc["seconds"]["training"]
    delta = training / acc["goodput_sync"] - training / acc["goodput"]
    assert delta == pytest.approx(acc["saves_kept"] * (0.3 - 0.02), rel=1e-6)


def test_a_slow_stall_loses_to_sync_at_any_load():
    for other in (0.0, 20.0):
        acc = account(*_traces(other, stall=0.5, sync=0.3))
        assert acc["goodput"] < acc["goodput_sync"]


def test_the_report_says_how_the_sync_figure_was_made():
    assert "estimated, not measured" in SYNC_BASIS and "'other' time are charged to both" in SYNC_BASIS
