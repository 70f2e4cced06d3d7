"""The tiling check: chunks must tile their tensor, decided in O(n log n) even for adversarial
layouts (issue 16, item 6), with the same verdict as comparing every pair of boxes."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
from _manifests import staircase, staircase_manifest

from goodput_ckpt.errors import CorruptCheckpointError
from goodput_ckpt.format.manifest import parse_manifest, seal_manifest
from goodput_ckpt.format.tiling import MAX_PAIR_CHECKS, TilingBudget, TilingError, check_tiling


def test_staircase_of_4000_columns_parses_in_n_log_n_steps():
    n = 4000
    raw = staircase_manifest(n)
    assert 500_000 < len(raw) < 1_000_000  # the case: a manifest of about 680 KB
    assert len(parse_manifest(raw).items["w"].chunks) == 2 * n
    budget = TilingBudget()
    check_tiling((n, n), staircase(n), budget)
    k = 2 * n
    # The old pairwise sweep compared about k^2 / 4 = 16 M pairs here; the sweep does a few
    # Fenwick steps (each at most log2 k) per box.
    assert budget.work <= 8 * k * math.ceil(math.log2(k)), budget.work
    assert budget.pairs_left == MAX_PAIR_CHECKS  # the pairwise fallback was not used


def test_work_grows_as_n_log_n():
    """Doubling the staircase about doubles the work (a quadratic check would quadruple it)."""
    work = []
    for n in (500, 1000, 2000):
        budget = TilingBudget()
        check_tiling((n, n), staircase(n), budget)
        work.append(budget.work)
    assert all(b < 2.5 * a for a, b in zip(work, work[1:])), work


def _overlaps_brute(boxes) -> bool:
    full = [b for b in boxes if math.prod(b[1])]
    return any(
        all(a < c + t and c < a + s for a, s, c, t in zip(o0, s0, o1, s1))
        for (o0, s0), (o1, s1) in itertools.combinations(full, 2)
    )


def _random_tiling(rng: random.Random, shape: list[int], pieces: int):
    """Guillotine splits of ``shape`` into about ``pieces`` boxes."""
    boxes = [([0] * len(shape), list(shape))]
    for _ in range(pieces):
        i = rng.randrange(len(boxes))
        o, s = boxes[i]
        d = rng.randrange(len(shape))
        if s[d] < 2:
            continue
        cut = rng.randrange(1, s[d])
        a = (list(o), s[:d] + [cut] + s[d + 1 :])
        b = (o[:d] + [o[d] + cut] + o[d + 1 :], s[:d] + [s[d] - cut] + s[d + 1 :])
        boxes[i : i + 1] = [a, b]
    return boxes


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_verdict_matches_comparing_every_pair(ndim):
    """Tilings are accepted; moving one box by one step (keeping the volume) is refused exactly
    when it makes two boxes overlap."""
    rng = random.Random(ndim)
    for _ in range(300):
        shape = [rng.randrange(1, 9) for _ in range(ndim)]
        boxes = _random_tiling(rng, shape, rng.randrange(1, 12))
        rng.shuffle(boxes)
        check_tiling(shape, boxes)
        i, d = rng.randrange(len(boxes)), rng.randrange(ndim)
        o, s = boxes[i]
        moved = o[:d] + [o[d] + rng.choice((-1, 1))] + o[d + 1 :]
        if not all(0 <= m and m + t <= n for m, t, n in zip(moved, s, shape)):
            continue
        mutated = boxes[:i] + [(moved, s)] + boxes[i + 1 :]
        if _overlaps_brute(mutated):
            with pytest.raises(TilingError, match="overlap"):
                check_tiling(shape, mutated)
        else:
            check_tiling(shape, mutated)


def test_three_split_dimensions_run_into_a_named_budget():
    """Splitting along three dimensions falls back to pairwise comparisons, which are capped:
    a layout needing more is refused with an error naming the limit, in bounded time."""
    n = 30  # one box for the bottom layer of an n x n x 2 tensor, unit boxes for the top one
    boxes = [((0, 0, 0), (n, n, 1))] + [((x, y, 1), (1, 1, 1)) for x, y in itertools.product(range(n), range(n))]
    check_tiling((n, n, 2), boxes)  # within the default budget
    with pytest.raises(TilingError, match="more than .* comparisons"):
        check_tiling((n, n, 2), boxes, TilingBudget(pairs=100))


def test_refusal_reaches_parse_manifest_as_corrupt():
    raw = json.loads(staircase_manifest(4))
    del raw["digest"]
    raw["items"]["w"]["chunks"][1]["offsets"] = [0, 0]  # the column's lower box moved onto its upper
    raw["items"]["w"]["chunks"][1]["sizes"] = [3, 1]
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        parse_manifest(seal_manifest(json.dumps(raw).encode()))
