"""CLI edges a real user hits (issue 20, item 5): pipes, destinations, exit codes, hints."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from goodput_ckpt.cli import EXIT_PIPE, EXIT_USAGE, main

REPO = str(Path(__file__).resolve().parents[2])


def run(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_a_closed_stdout_pipe_exits_quietly(sample_ckpt):
    """``inspect CKPT | head -1``: the reader is gone before anything is written (its end of
    the pipe is closed at once), so every write meets EPIPE; no message, SIGPIPE's status."""
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.Popen(
        [sys.executable, "-m", "goodput_ckpt.cli", "inspect", str(sample_ckpt[0])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == EXIT_PIPE, err
    assert err == ""


def test_the_overwrite_hint_fits_the_caller(sample_ckpt, tmp_path):
    from goodput_ckpt.errors import CheckpointExistsError
    from goodput_ckpt.tools.ops.convert import convert_checkpoint

    dst = tmp_path / "out"
    assert run("convert", sample_ckpt[0], dst, "--to", "dcp")[0] == 0
    code, _, err = run("convert", sample_ckpt[0], dst, "--to", "dcp")
    assert code == EXIT_USAGE and err.count("--overwrite") == 1 and "overwrite=True" not in err, err
    with pytest.raises(CheckpointExistsError) as e:
        convert_checkpoint(str(sample_ckpt[0]), str(dst), to="dcp")
    assert "overwrite=True" in str(e.value) and "--overwrite" not in str(e.value)


def test_shard_size_with_a_single_safetensors_file_is_refused(sample_ckpt, tmp_path):
    code, _, err = run(
        "convert", sample_ckpt[0], tmp_path / "m.safetensors", "--to", "safetensors", "--shard-size", "1MB"
    )
    assert code == EXIT_USAGE and "single .safetensors file" in err
    assert not (tmp_path / "m.safetensors").exists()


def test_a_memory_destination_is_refused_from_the_cli(sample_ckpt):
    code, _, err = run("convert", sample_ckpt[0], "memory://out/x", "--to", "goodput")
    assert code == EXIT_USAGE and "vanish" in err
    code, _, err = run("reshard", sample_ckpt[0], "memory://out/y", "--world-size", "1")
    assert code == EXIT_USAGE and "vanish" in err
