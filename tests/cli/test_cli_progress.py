"""Progress bars that appear (issue 35, item 2), seen through a real pseudo-terminal.

Every long command (verify, reshard, convert, bench, ls --verify) draws a bar on a terminal
(bytes done and in all, rate, time left), and nothing on a pipe or with ``--json``. Why a 9 s
``reshard`` drew nothing: the terminal reported 0 columns and 0 rows (a pseudo-terminal whose
size nobody set), which tqdm lays out as an empty bar hidden below row 0; and the 1 s delay
counted from the phase's start, while start-up (importing torch and DCP) took most of the
command. The commands run as real subprocesses of the CLI on a pty; the launcher only sets
``BAR_DELAY`` to 0, so that a small checkpoint draws without any test depending on timing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
import torch
from helpers.samples import copy_ckpt

from goodput_ckpt.cli import _output

#: A bar line: what, percent, bytes done / in all, elapsed < remaining, rate.
BAR = re.compile(r"(\w+): +\d+%\|[^|]*\| [\d.]+[kMGT]?B/[\d.]+[kMGT]?B \[\d\d:\d\d<[\d:?]+, [\d.?]+ ?[kMGT]?B/s\]")
LAUNCH = "import sys, goodput_ckpt.cli._output as o; o.BAR_DELAY = {delay}; from goodput_ckpt.cli import main; sys.exit(main(sys.argv[1:]))"


def _on_pty(argv, tmp_path, *, size=(100, 24), delay=0.0, timeout=300.0) -> tuple[int, str, str]:
    """Run the CLI with stderr on a new pty of ``size`` (columns, rows; ``None``: never set,
    as a bare ``openpty`` leaves it) and stdout in a file; returns (exit code, stdout, pty text)."""
    master, slave = os.openpty()
    if size is not None:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
    out_path = tmp_path / f"stdout-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCH.format(delay=delay), *map(str, argv)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=slave,
            env=env,
            cwd=tmp_path,
        )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer closed the pty
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return code, out_path.read_text(), b"".join(chunks).decode("utf-8", "replace")


def _bars(text: str) -> set[str]:
    return {m.group(1) for m in BAR.finditer(text)}


@pytest.fixture(scope="module")
def root(sample_ckpt, tmp_path_factory):
    """A root of two checkpoints (for ls --verify) and a torch file (for convert)."""
    base = tmp_path_factory.mktemp("progress")
    for step in (10, 20):
        copy_ckpt(sample_ckpt[0], base / "root" / f"step_{step:08d}")
    torch.save({"w": torch.arange(4096.0)}, base / "a.pt")
    return base


@pytest.mark.parametrize(
    "argv, phase",
    [
        (["verify", "{ckpt}"], "verify"),
        (["ls", "{root}", "--verify"], "verify"),
        (["reshard", "{ckpt}", "{out}", "--world-size", "2", "--rank-state", "keep"], "write"),
        (["convert", "{pt}", "{out}", "--to", "goodput"], "write"),
        (["convert", "{ckpt}", "{out}.pt", "--to", "torch"], "write"),
        (["convert", "{ckpt}", "{out}", "--to", "dcp"], "write"),
    ],
)
def test_a_bar_with_bytes_rate_and_eta_on_a_terminal_none_with_json(root, tmp_path, argv, phase):
    names = {"ckpt": root / "root" / "step_00000010", "root": root / "root", "pt": root / "a.pt"}
    fill = [a.format(out=tmp_path / "out", **names) for a in argv]
    code, _, text = _on_pty(fill, tmp_path)
    assert code == 0, text
    assert phase in _bars(text), text
    code, stdout, text = _on_pty(fill[:2] + [a.replace("out", "out-json") for a in fill[2:]] + ["--json"], tmp_path)
    assert code == 0 and json.loads(stdout) and not _bars(text) and "%|" not in text, text


def test_the_bench_draws_one_bar_with_its_lines_above(tmp_path):
    code, _, text = _on_pty(["bench", tmp_path, "--size", "8MiB", "--repeats", "1", "--quiet", "0"], tmp_path)
    assert code == 0, text
    assert "bench" in _bars(text) and "[1/1] goodput: save, load, verify" in text, text
    code, stdout, text = _on_pty(
        ["bench", tmp_path, "--size", "8MiB", "--repeats", "1", "--quiet", "0", "--json"], tmp_path
    )
    assert code == 0 and json.loads(stdout)["schema"] and not _bars(text), text


def test_a_terminal_that_reports_no_size_still_gets_a_bar(root, tmp_path):
    """The cause of the empty 9 s reshard: tqdm drew a 0-column bar, hidden below row 0."""
    code, _, text = _on_pty(["verify", root / "root" / "step_00000010"], tmp_path, size=None)
    assert code == 0 and "verify" in _bars(text), text


def test_nothing_on_a_pipe(root, tmp_path):
    launch = LAUNCH.format(delay=0.0)
    p = subprocess.run(
        [sys.executable, "-c", launch, "verify", str(root / "root" / "step_00000010")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert p.returncode == 0 and "%|" not in p.stderr and not _bars(p.stderr), p.stderr


def test_the_delay_counts_from_the_command_start():
    """A phase that starts after BAR_DELAY seconds of a command (its imports, earlier phases)
    draws at once; one that starts at the command's start waits. Real tqdm on a real pty."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        with os.fdopen(os.dup(slave), "w") as tty:
            late = _output._Bar(tty, time.monotonic() - 10 * _output.BAR_DELAY)
            late.start(1 << 20, "write")
            late.close()
            fresh = _output._Bar(
                tty, time.monotonic() + 3600
            )  # a command that "started" in the future never reaches the delay
            fresh.start(1 << 20, "verify")
            fresh.advance(1 << 19)
            fresh.close()
            tty.flush()
        text = b""
        while select.select([master], [], [], 0.2)[0]:
            text += os.read(master, 1 << 16)
    finally:
        os.close(master)
        os.close(slave)
    assert _bars(text.decode()) == {"write"}
