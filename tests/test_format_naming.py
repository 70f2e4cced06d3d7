"""One name and one number for the format (issue 35, item 5).

README.md, docs/tools.md and the package docstrings said "format v1" while ``inspect``,
``verify``, docs/format.md and ``schema.py`` said version 2. The naming now: the *format
version* is the manifest's ``version`` (``FORMAT_VERSION``); a ``CheckpointManager``
checkpoint's *training-state schema* (``SCHEMA_VERSION`` in ``state/bundle/meta.py``) is another
number. Every mention of a format version in the docs, the README and the code (docstrings,
comments, CLI help) must name the one writers emit, read here from its constant; history is
told as "version 1 manifests" or "version 1 of the format".
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import torch

from goodput_ckpt import CheckpointManager
from goodput_ckpt.cli import main
from goodput_ckpt.format.schema import FORMAT_VERSION
from goodput_ckpt.state.bundle import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parent.parent
#: "format v1", "format-v1", "format version 1", "format-version-1", "format, version 1" (a title).
MENTION = re.compile(r"\bformat(?:[ -]v|[ -]version[ -]|, version )(\d+)\b", re.IGNORECASE)


def _texts():
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").glob("*.md"))
    yield from sorted((ROOT / "goodput_ckpt").rglob("*.py"))
    yield from sorted((ROOT / "benchmarks").glob("*.py"))


def test_every_mention_of_the_format_version_is_the_current_one():
    wrong, seen = [], 0
    for path in _texts():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in MENTION.finditer(line):
                seen += 1
                if int(m.group(1)) != FORMAT_VERSION:
                    wrong.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not wrong, f"these say another format version than {FORMAT_VERSION}:\n" + "\n".join(wrong)
    assert seen >= 3  # the README, docs/format.md's title, the package docstring


def test_the_spec_title_and_the_readme_name_it():
    assert f"# goodput-ckpt format, version {FORMAT_VERSION}" in (ROOT / "docs" / "format.md").read_text()
    assert f"format version {FORMAT_VERSION}" in (ROOT / "README.md").read_text()


def test_inspect_and_verify_say_format_version_and_training_schema_apart(tmp_path):
    with CheckpointManager(str(tmp_path / "root"), async_save=False) as cm:
        cm.save(3, model=torch.nn.Linear(2, 2))
    step = str(tmp_path / "root" / "step_00000003")
    out = io.StringIO()
    assert main(["inspect", step, "--summary"], stdout=out, stderr=io.StringIO()) == 0
    text = out.getvalue()
    assert f"goodput-ckpt, format version {FORMAT_VERSION} (" in text
    assert f"training-state schema {SCHEMA_VERSION}" in text
    out = io.StringIO()
    assert main(["verify", step], stdout=out, stderr=io.StringIO()) == 0
    assert f": format version {FORMAT_VERSION}, world size 1" in out.getvalue()
