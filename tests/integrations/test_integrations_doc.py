"""docs/integrations.md's examples run as written (their paths moved into a temporary directory),
and the checkpoints they leave are ours and verify: Lightning, the Hugging Face Trainer,
Accelerate, and torchtitan (in a spawned one-rank process, when torchtitan is installed)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from goodput_ckpt.format.manifest import MANIFEST_NAME

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def _example(section: str, **paths: str) -> str:
    """The first Python block of ``## <section>``, with each path in ``paths`` replaced."""
    text = PAGE.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"docs/integrations.md lost its {section} example"
    code = blocks[0]
    for old, new in paths.items():
        assert old in code, f"the {section} example no longer uses {old}"
        code = code.replace(old, new)
    return code


def _run(code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, str(PAGE), "exec"), namespace)  # noqa: S102 - our own docs
    return namespace


def _verified(path: Path) -> bool:
    from goodput_ckpt.tools.verify import verify_checkpoint

    return (path / MANIFEST_NAME).is_file() and verify_checkpoint(str(path)).ok


def _last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_lightning_example_runs(tmp_path, capsys):
    pytest.importorskip("lightning")
    ns = _run(_example("PyTorch Lightning", **{"/tmp/lightning-ckpts": str(tmp_path / "ckpts")}))
    assert ns["resumed"].global_step == 12
    assert _last_line(capsys) == "12"
    assert _verified(tmp_path / "ckpts" / "last.ckpt")


def test_hf_trainer_example_runs(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    ns = _run(_example("Hugging Face Trainer", **{"/tmp/hf-ckpts": str(tmp_path / "ckpts")}))
    assert ns["resumed"].state.global_step == 12
    assert _last_line(capsys) == "12"
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    assert _verified(tmp_path / "ckpts" / "checkpoint-8")


def test_accelerate_example_runs(tmp_path, capsys):
    pytest.importorskip("accelerate")
    pytest.importorskip("torchdata")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # another test's Accelerator may be set up
    GradientState._reset_state()
    _run(_example("Hugging Face Accelerate", **{"/tmp/accelerate-ckpt": str(tmp_path / "ckpt")}))
    assert _last_line(capsys) == "2"
    assert _verified(tmp_path / "ckpt")


def _run_torchtitan_example(rank: int, world_size: int, code: str, out: str) -> None:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        _run(code)
    Path(out).write_text(buf.getvalue())


@pytest.mark.multiproc
def test_torchtitan_example_runs(tmp_path):
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed (not in the test extra: docs/integrations.md says why)")
    from helpers.dist import run_ranks

    code = _example("torchtitan", **{"/tmp/titan-run": str(tmp_path / "run")})
    run_ranks(_run_torchtitan_example, 1, code, str(tmp_path / "out.txt"), report_dir=tmp_path / "report", timeout=300)
    assert (tmp_path / "out.txt").read_text().split() == ["True", "True"]
    assert _verified(tmp_path / "run" / "ckpt" / "step-5")
