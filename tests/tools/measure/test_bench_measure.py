"""The measurement procedure goodput-ckpt bench and benchmarks/bench_local.py share (tools/measure/_bench_measure.py).

Real files and real callables that record what ran when; no assertion is about speed.
"""

from __future__ import annotations

import os
import shutil

import pytest

from goodput_ckpt.tools.measure._bench_measure import (
    Load,
    ratio_spread,
    rotated,
    run_rotation,
    save_and_load,
    wait_quiet,
)


def test_order_rotates_by_one_per_repeat():
    assert [rotated("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert [rotated(["goodput", "torch"], r) for r in range(3)] == [
        ["goodput", "torch"],
        ["torch", "goodput"],
        ["goodput", "torch"],
    ]
    calls: list[tuple[str, int]] = []
    order = run_rotation(["a", "b", "c"], 2, lambda n, r: calls.append((n, r)))
    assert order == [["a", "b", "c"], ["b", "c", "a"]]
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1)]
    assert rotated([], 3) == []


def test_save_and_load_runs_the_steps_in_order(tmp_path):
    events: list[str] = []
    target, warm = str(tmp_path / "t"), str(tmp_path / "t-warm")

    def save(where: str) -> None:
        events.append(f"save {os.path.basename(where)} warm_exists={os.path.exists(warm)}")
        os.makedirs(where)
        (tmp_path / os.path.basename(where) / "data").write_bytes(b"x" * 4096)

    def remove(where: str) -> None:
        events.append(f"remove {os.path.basename(where)}")
        shutil.rmtree(where, ignore_errors=True)

    def evict(where: str) -> bool:
        events.append(f"evict {os.path.basename(where)}")
        return True

    def load(name: str):
        def run(where: str) -> str:
            events.append(f"load {name}")
            return (tmp_path / "t" / "data").read_bytes().decode()[:1] + name

        return run

    loads = [Load("a", load("a"), lambda got: events.append(f"after {got}")), Load("b", load("b"))]
    got = save_and_load(
        save,
        loads,
        target=target,
        warm=warm,
        remove=remove,
        evict=evict,
        quiet=0,
        between=lambda w: events.append(f"between {os.path.basename(w)}"),
    )
    assert events == [
        "save t-warm warm_exists=False",
        "remove t-warm",  # the warm-up, deleted before the clock
        "save t warm_exists=False",
        "between t",
        "evict t",
        "load a",
        "after xa",  # each load: evicted first, checked after (untimed)
        "evict t",
        "load b",
        "remove t",
    ]
    assert list(got.loads) == ["a", "b"] and got.cold == [True, True]
    assert got.save.wall > 0 and got.save.cpu >= 0 and got.save.other >= 0
    assert not os.path.exists(target) and not os.path.exists(warm)


def test_keep_leaves_the_checkpoint_and_a_failed_load_still_removes_it(tmp_path):
    def save(where: str) -> None:
        os.makedirs(where)

    kw = dict(remove=lambda w: shutil.rmtree(w, ignore_errors=True), evict=lambda w: None, quiet=0)
    got = save_and_load(save, [], target=str(tmp_path / "k"), warm=str(tmp_path / "k-w"), keep=True, **kw)
    assert (tmp_path / "k").is_dir() and not (tmp_path / "k-w").exists() and got.loads == {}

    def broken(where: str) -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        save_and_load(save, [Load("x", broken)], target=str(tmp_path / "f"), warm=str(tmp_path / "f-w"), **kw)
    assert not (tmp_path / "f").exists()


def test_ratio_spread_pairs_the_repeats():
    # other takes 1, 2, 4 s; base 2, 2, 2 s: per repeat 2x, 1x, 0.5x (not the ratio of sorted lists)
    r = ratio_spread([1.0, 2.0, 4.0], [2.0, 2.0, 2.0])
    assert r.per_repeat == (2.0, 1.0, 0.5)
    assert (r.min, r.median, r.max) == (0.5, 1.0, 2.0) and r.of_medians == 1.0
    assert r.text() == "0.50 / 1.00 / 2.00x"
    # pairing matters: the same samples in another order give other per-repeat ratios
    assert ratio_spread([4.0, 2.0, 1.0], [1.0, 2.0, 4.0]).per_repeat == (0.25, 1.0, 4.0)
    assert ratio_spread([], []) is None and ratio_spread([0.0], [1.0]) is None
    with pytest.raises(ValueError, match="same repeats"):
        ratio_spread([1.0], [1.0, 2.0])


def test_wait_quiet_zero_does_not_wait():
    assert wait_quiet(0) == 0.0
    waited = wait_quiet(0.2, window=0.1)  # waits at least one window, at most about max_wait + a window
    assert 0.1 <= waited < 5


def test_spread_of_reports_min_median_max_and_every_repeat_and_refuses_no_repeat():
    from goodput_ckpt.tools.measure._bench_measure import spread_of

    assert spread_of([3.0, 1.0, 2.0, 10.0]) == {"min": 1.0, "median": 2.5, "max": 10.0, "all": [3.0, 1.0, 2.0, 10.0]}
    assert spread_of(x for x in (4.0,)) == {"min": 4.0, "median": 4.0, "max": 4.0, "all": [4.0]}
    with pytest.raises(ValueError, match="at least one repeat"):
        spread_of([])
