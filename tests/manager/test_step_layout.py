"""The manager root layout (goodput_ckpt/manager/step_layout.py): step directory names, parsing and listing."""

from __future__ import annotations

import pytest

from goodput_ckpt.manager.step_layout import child_uri, list_step_dirs, parse_step_dir, step_dir_name
from goodput_ckpt.storage import open_store


def test_names_round_trip_and_sort_by_step():
    for step in (0, 1, 1000, 99_999_999, 123_456_789):
        assert parse_step_dir(step_dir_name(step)) == step
    assert step_dir_name(1000) == "step_00001000"
    names = [step_dir_name(s) for s in (5, 40, 300, 99_999_999)]
    assert sorted(names) == names


@pytest.mark.parametrize(
    "name", ["step_1", "step_0000001", "step_00000001x", "step_-0000001", "Step_00000001", "step_000000001", "x"]
)
def test_non_canonical_names_are_not_steps(name):
    assert parse_step_dir(name) is None


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_steps(bad):
    with pytest.raises(ValueError):
        step_dir_name(bad)


def test_child_uri():
    assert child_uri("/a/b", "step_1") == "/a/b/step_1"
    assert child_uri("/a/b/", "x") == "/a/b/x"
    assert child_uri("s3://bucket/prefix", "x") == "s3://bucket/prefix/x"
    assert child_uri("/", "x") == "/x"


def test_list_step_dirs(tmp_path):
    for name in ("step_00000002", "step_00000010", "junk", "step_2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    (tmp_path / "step_00000010" / "sub").mkdir()
    (tmp_path / "step_00000010" / "sub" / "g").write_text("x")
    (tmp_path / "step_00000003").mkdir()  # empty: not listed
    assert list_step_dirs(open_store(tmp_path)) == {2: ["f"], 10: ["f", "sub/g"]}
