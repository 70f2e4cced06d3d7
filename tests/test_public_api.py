"""The package root (goodput_ckpt/__init__.py) exports exactly the documented public API.

The list lives in the README's "Public API" section; ``__all__`` must name the same things, so an
export cannot be added or dropped without the documentation saying so.
"""

from __future__ import annotations

import re
from pathlib import Path

import goodput_ckpt

README = Path(__file__).resolve().parents[1] / "README.md"


def _documented() -> set[str]:
    section = re.search(r"^## Public API\n(.*?)^## ", README.read_text(), flags=re.S | re.M)
    assert section, "README lost its Public API section"
    bullets = re.findall(r"^- .*(?:\n  .*)*", section.group(1), flags=re.M)  # a bullet and its continuation lines
    return {name for b in bullets for name in re.findall(r"`(\w+)`", b)}


def test_all_is_the_documented_list():
    documented = _documented()
    assert {"CheckpointManager", "TopologyChangeError"} <= documented
    assert set(goodput_ckpt.__all__) == documented
    assert len(goodput_ckpt.__all__) == len(set(goodput_ckpt.__all__))


def test_every_export_resolves():
    for name in goodput_ckpt.__all__:
        assert getattr(goodput_ckpt, name) is not None, name


def test_errors_form_one_hierarchy():
    errors = [n for n in goodput_ckpt.__all__ if n.endswith("Error")]
    assert "TopologyChangeError" in errors
    for name in errors:
        assert issubclass(getattr(goodput_ckpt, name), goodput_ckpt.CheckpointError), name
    assert issubclass(goodput_ckpt.CheckpointError, Exception)
    from goodput_ckpt import errors as errors_module

    assert goodput_ckpt.TopologyChangeError is errors_module.TopologyChangeError
