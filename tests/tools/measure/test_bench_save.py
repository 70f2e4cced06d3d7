"""The shared rule for timing a save (tools/measure/_bench_save.py): a warm-up save, deleted, then the timed one."""

from __future__ import annotations

import os
import shutil

from goodput_ckpt.tools.measure._bench_save import timed_save


def test_warm_up_save_runs_first_and_is_gone_before_the_timed_save(tmp_path):
    seen: list[tuple[str, bool]] = []  # (where, did the warm-up location exist at that moment)
    warm, target = str(tmp_path / "warm"), str(tmp_path / "target")

    def save(where: str) -> None:
        seen.append((where, os.path.exists(warm)))
        os.makedirs(where)
        with open(os.path.join(where, "data"), "wb") as f:
            f.write(b"x" * 4096)

    def clock(fn):
        n = len(seen)
        fn()
        return [w for w, _ in seen[n:]]  # what ran inside the clock

    timed = timed_save(save, target, warm=warm, remove=shutil.rmtree, clock=clock)
    assert timed == [target]  # only the second save is timed
    assert seen == [(warm, False), (target, False)]  # the warm-up ran first and was deleted before
    assert os.path.exists(os.path.join(target, "data")) and not os.path.exists(warm)


def test_default_clock_is_wall_seconds(tmp_path):
    t = timed_save(lambda w: os.makedirs(w), str(tmp_path / "t"), warm=str(tmp_path / "w"), remove=shutil.rmtree)
    assert isinstance(t, float) and t >= 0
