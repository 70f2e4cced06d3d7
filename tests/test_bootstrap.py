"""tools/bootstrap prints one line per step (issue 35, item 7).

pip's -q does not silence what the build backend prints, so the editable install showed
setuptools' warning block. The script now logs each step's output and shows it only when the
step fails. It is run here as it is, from a copy of the repository layout whose ``.venv``
python is a stand-in (a real reinstall is what the script is for, and too slow for a test):
the stand-in's pip prints a warning block like setuptools' and can be told to fail.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARNING = "!!\n        ********************************************************************************\n        Please avoid running ``setup.py`` directly. (an editable-install warning)\n"

FAKE_PYTHON = f"""#!/bin/sh
# A .venv python: pip prints noise (and fails when FAIL_STEP names the step); -c runs the real python.
case "$*" in
  *"install -q --upgrade pip"*) echo "pip upgrade noise"; exit 0 ;;
  *"install -q -e"*) echo "Obtaining file:///repo"; printf '%s' '{WARNING}' >&2
                     [ "$FAIL_STEP" = editable ] && exit 3; exit 0 ;;
  *"install -q"*) echo "Collecting torch"; printf '%s' '{WARNING}' >&2; exit 0 ;;
  "-c "*) shift; exec {sys.executable} -c "$1" ;;
esac
echo "unexpected: $*" >&2; exit 99
"""


def _layout(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy2(ROOT / "tools" / "bootstrap", repo / "tools" / "bootstrap")
    venv_bin = repo / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    stubs = tmp_path / "stubs"
    for name, version in (("goodput_ckpt", "9.9"), ("torch", "0.0")):
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(f"__version__ = {version!r}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for path, text in (
        (venv_bin / "python", FAKE_PYTHON),
        (bin_dir / "fusermount3", "#!/bin/sh\n"),
        (bin_dir / "rclone", "#!/bin/sh\n"),
    ):
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(stubs),
        "TMPDIR": str(tmp_path),
        "HOME": str(tmp_path),
    }
    return repo, env


def test_one_line_per_step_and_no_backend_noise(tmp_path):
    repo, env = _layout(tmp_path)
    p = subprocess.run(
        ["bash", str(repo / "tools" / "bootstrap")], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "bootstrap: installed torch==2.13.0",
        "bootstrap: installed goodput-ckpt (editable, with test extras)",
        "bootstrap: ready: goodput-ckpt 9.9 torch 0.0",
    ]
    assert p.stderr == ""
    assert not list(tmp_path.glob("goodput-bootstrap.*"))  # the step log is removed


def test_a_failing_step_shows_its_output_and_exit_status(tmp_path):
    repo, env = _layout(tmp_path)
    p = subprocess.run(
        ["bash", str(repo / "tools" / "bootstrap")],
        capture_output=True,
        text=True,
        env={**env, "FAIL_STEP": "editable"},
        timeout=120,
    )
    assert p.returncode == 3
    assert p.stdout.splitlines() == ["bootstrap: installed torch==2.13.0"]
    assert p.stderr.startswith("bootstrap: installed goodput-ckpt (editable, with test extras) failed (exit 3):\n")
    assert "Obtaining file:///repo" in p.stderr and "editable-install warning" in p.stderr
