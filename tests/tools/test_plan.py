"""The goodput model against closed forms and a brute-force optimum."""

from __future__ import annotations

import math

import pytest

from goodput_ckpt.tools.plan import PlanInputs, goodput, mtbf_from_fleet, optimal_interval, plan


def test_young_daly_closed_forms():
    assert optimal_interval(60, 3 * 3600) == pytest.approx(
        math.sqrt(2 * 60 * 10800) * (1 + math.sqrt(60 / 21600) / 3 + (60 / 21600) / 9) - 60
    )
    assert optimal_interval(10_000, 1_000) == 1_000  # stall >= 2M: checkpoint once per MTBF
    assert optimal_interval(0, 1_000) == 0.0


def test_optimum_is_near_the_true_maximum_of_the_model():
    p = PlanInputs(stall=30, mtbf=4 * 3600, restore=120, restart=300, persist=60)
    result = plan(p)
    grid = [10 * i for i in range(1, 2000)]
    best = max(grid, key=lambda t: goodput(t, p))
    # Daly's first/higher-order optimum is within a few percent of the model's true maximum,
    # and the goodput there is within 0.05 percentage points of the best.
    assert abs(result.optimal_interval - best) / best < 0.05
    assert goodput(best, p) - result.goodput_at_optimum < 5e-4
    assert result.young_interval == pytest.approx(math.sqrt(2 * 30 * 4 * 3600))


def test_current_interval_and_sensitivities():
    p = PlanInputs(stall=20, mtbf=2 * 3600, restore=60, restart=120, current_interval=3600)
    result = plan(p)
    assert result.goodput_at_current is not None
    assert result.goodput_at_current < result.goodput_at_optimum
    s = result.sensitivity
    assert s["stall"] < 0 and s["restore"] < 0 and s["restart"] < 0  # doubling a cost hurts
    assert s["mtbf"] > 0  # doubling the MTBF helps
    assert s["persist"] == 0.0  # zero input: nothing to double


def test_goodput_formula_and_bounds():
    p = PlanInputs(stall=10, mtbf=1000, restore=5, restart=5)
    tau = 100
    assert goodput(tau, p) == pytest.approx(100 / 110 * (1 - (10 + 55) / 1000))
    assert goodput(10_000, p) == 0.0  # clipped: failures eat everything
    assert mtbf_from_fleet(1000, 0.001) == pytest.approx(3600.0)


@pytest.mark.parametrize(
    "kwargs", [dict(stall=-1, mtbf=10), dict(stall=1, mtbf=0), dict(stall=1, mtbf=float("inf")), dict(stall=1, mtbf=10, current_interval=0)]
)
def test_bad_inputs(kwargs):
    with pytest.raises(ValueError):
        PlanInputs(**kwargs)
