"""The goodput-ckpt command: exit codes, --json, messages without tracebacks, --help, progress.

Most checks call ``main()`` in this process (a fresh interpreter per call costs seconds); a few
run the installed console script to see exactly what a user sees.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.samples import Opaque, copy_ckpt, flip_byte, item_range, manifest

from goodput_ckpt import __version__
from goodput_ckpt.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from goodput_ckpt.cli._output import Output, parse_size
from goodput_ckpt.format import MANIFEST_NAME
from goodput_ckpt.format.manifest import FORMAT_VERSION

SCRIPT = shutil.which("goodput-ckpt", path=str(Path(sys.executable).parent)) or "goodput-ckpt"


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def corrupt(ckpt):
    f, off, _ = item_range(ckpt, "model.embed.weight")
    flip_byte(ckpt, f, off + 100)
    return ckpt


@pytest.fixture
def incomplete(ckpt):
    (ckpt / MANIFEST_NAME).unlink()
    return ckpt


# -- verify ------------------------------------------------------------------------------------
def test_verify_exit_codes_and_json(sample_ckpt, corrupt, tmp_path):
    code, out, _ = run("verify", sample_ckpt[0])
    assert code == EXIT_OK and out.startswith("OK ")
    code, out, _ = run("verify", sample_ckpt[0], "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True and doc["status"] == "ok" and doc["problems"] == []
    code, out, _ = run("verify", corrupt, "--json")
    doc = json.loads(out)
    assert code == EXIT_FAILED and doc["status"] == "corrupt"
    (p,) = doc["problems"]
    assert p["kind"] == "checksum" and p["keys"] == ["model.embed.weight"] and len(p["byte_range"]) == 2
    code, out, _ = run("verify", corrupt)
    assert code == 1 and out.startswith("CORRUPT") and "model.embed.weight" in out
    code, out, _ = run("verify", corrupt, "--quick")
    assert code == 0
    code, out, err = run("verify", tmp_path / "missing")
    assert code == EXIT_USAGE and "no checkpoint" in err and out == ""
    code, out, err = run("verify", tmp_path / "missing", "--json")
    doc = json.loads(out)
    assert code == 2 and doc["ok"] is False and doc["error"]["type"] == "CheckpointNotFoundError"


def test_verify_incomplete(incomplete):
    code, out, _ = run("verify", incomplete)
    assert code == 1 and out.startswith("INCOMPLETE")
    assert json.loads(run("verify", incomplete, "--json")[1])["status"] == "incomplete"


# -- inspect -----------------------------------------------------------------------------------
def test_inspect(sample_ckpt, incomplete, tmp_path):
    code, out, _ = run("inspect", sample_ckpt[0])
    assert code == 0
    for text in (
        f"goodput-ckpt, format version {FORMAT_VERSION}",
        "step        100",
        "world size  1",
        "SECTION",
        "optimizer",
        "KEY",
        "model.embed.weight",
        "1001x64",
    ):
        assert text in out, text
    code, out, _ = run("inspect", sample_ckpt[0], "--keys", "rng.*", "--json")
    doc = json.loads(out)
    assert code == 0 and [i["key"] for i in doc["items"]] == ["rng.rank0.cpu"] and doc["step"] == 100
    code, out, _ = run("inspect", sample_ckpt[0], "--summary")
    assert "KEY" not in out and "SECTION" in out
    code, _, err = run("inspect", incomplete)
    assert code == 1 and "never committed" in err and "Traceback" not in err
    assert run("inspect", tmp_path / "none")[0] == 2


def test_inspect_warns_about_damaged_files(ckpt):
    f, _, _ = item_range(ckpt, "model.embed.weight")
    os.truncate(ckpt / f, 10)
    code, out, err = run("inspect", ckpt)
    assert code == 1 and "KEY" in out and f in err


# -- ls ----------------------------------------------------------------------------------------
def test_ls(sample_ckpt, tmp_path):
    root = tmp_path / "run"
    copy_ckpt(sample_ckpt[0], root / "step_00000010")
    bad = copy_ckpt(sample_ckpt[0], root / "step_00000020")
    f, off, _ = item_range(bad, "model.embed.weight")
    flip_byte(bad, f, off)
    (copy_ckpt(sample_ckpt[0], root / "step_00000030") / MANIFEST_NAME).unlink()
    code, out, _ = run("ls", root)
    assert code == 0 and "latest complete: 20" in out and "incomplete" in out
    code, out, err = run("ls", root, "--verify")
    assert code == 1 and "latest complete: 10" in out and "corrupt" in out and "checksum" in err
    code, out, _ = run("ls", root, "--json")
    doc = json.loads(out)
    assert [(c["step"], c["status"]) for c in doc["checkpoints"]] == [
        (10, "complete"),
        (20, "complete"),
        (30, "incomplete"),
    ]
    assert doc["latest_complete"] == 20
    assert run("ls", tmp_path / "nothing")[0] == 2


# -- reshard -----------------------------------------------------------------------------------
def test_reshard(sample_ckpt, corrupt, tmp_path):
    src = sample_ckpt[0]
    code, out, _ = run("reshard", src, tmp_path / "w2", "--world-size", "2", "--rank-state", "keep")
    assert code == 0 and "1 rank) ->" in out and "(2 ranks)" in out
    assert manifest(tmp_path / "w2")["world_size"] == 2
    code, out, _ = run(
        "reshard", src, tmp_path / "w3", "-w", "3", "--rank-state", "drop", "--json", "--chunk-size", "64KiB"
    )
    doc = json.loads(out)
    assert code == 0 and doc["world_size"] == 3 and len(doc["files"]) == 3 and doc["gbps"] >= 0
    code, _, err = run("reshard", src, tmp_path / "w4", "--world-size", "4")  # auto refuses: per-rank state
    assert code == EXIT_USAGE and "--rank-state" in err and not (tmp_path / "w4" / MANIFEST_NAME).exists()
    code, _, err = run("reshard", src, tmp_path / "w2", "--world-size", "2", "--rank-state", "keep")
    assert code == EXIT_USAGE and "overwrite" in err
    assert run("reshard", src, tmp_path / "w2", "-w", "2", "--rank-state", "keep", "--overwrite")[0] == 0
    code, _, err = run("reshard", corrupt, tmp_path / "c", "-w", "2", "--rank-state", "keep")
    assert code == EXIT_FAILED and "checksum mismatch" in err
    assert run("reshard", src, tmp_path / "x")[0] == EXIT_USAGE  # --world-size is required
    assert run("reshard", src, tmp_path / "x", "-w", "0")[0] == EXIT_USAGE


# -- convert -----------------------------------------------------------------------------------
def test_convert(sample_ckpt, tmp_path):
    src = sample_ckpt[0]
    code, out, _ = run("convert", src, tmp_path / "m.safetensors", "--to", "safetensors")
    assert code == 0 and "(goodput) ->" in out and "m.objects.json" in out
    code, out, _ = run("convert", tmp_path / "m.safetensors", tmp_path / "back", "--to", "goodput", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["src_format"] == "safetensors" and doc["tensors"] > 0
    code, out, _ = run("convert", src, tmp_path / "hf", "--to", "safetensors", "--shard-size", "200KB")
    assert code == 0 and "model.safetensors.index.json" in out
    assert run("convert", src, tmp_path / "x", "--to", "onnx")[0] == EXIT_USAGE
    assert run("convert", src, tmp_path / "m.safetensors", "--to", "safetensors")[0] == EXIT_USAGE  # exists
    pt = tmp_path / "custom.pt"
    torch.save({"w": torch.ones(2), "o": Opaque(1)}, pt)
    code, _, err = run("convert", pt, tmp_path / "c", "--to", "goodput")
    assert code == EXIT_FAILED and "--trust-pickle" in err
    assert run("convert", pt, tmp_path / "c", "--to", "goodput", "--trust-pickle")[0] == 0


# -- common behaviour --------------------------------------------------------------------------
def test_help_lists_commands_and_examples(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for name in ("verify", "inspect", "ls", "reshard", "convert", "examples:"):
        assert name in text
    for name in ("verify", "inspect", "ls", "reshard", "convert"):
        assert main([name, "--help"]) == 0
        sub = capsys.readouterr().out
        assert "examples:" in sub and f"goodput-ckpt {name}" in sub and "--json" in sub
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"goodput-ckpt {__version__}"
    assert main([]) == EXIT_USAGE
    assert main(["frobnicate"]) == EXIT_USAGE


def test_backend_options(sample_ckpt):
    assert run("verify", sample_ckpt[0], "-o", "fsync=false")[0] == 0
    code, _, err = run("verify", sample_ckpt[0], "-o", "bogus=1")
    assert code == EXIT_USAGE and "bogus" in err
    assert run("verify", sample_ckpt[0], "-o", "novalue")[0] == EXIT_USAGE


def test_console_script_messages_have_no_traceback(sample_ckpt, corrupt, tmp_path):
    def script(*args):
        return subprocess.run([SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=300)

    p = script("verify", tmp_path / "nope")
    assert p.returncode == 2 and "error: no checkpoint" in p.stderr and "Traceback" not in p.stderr
    p = script("verify", corrupt, "--json")
    assert p.returncode == 1 and json.loads(p.stdout)["status"] == "corrupt" and "Traceback" not in p.stderr
    p = script("reshard", sample_ckpt[0], tmp_path / "o", "--world-size", "3")
    assert p.returncode == 2 and "--rank-state" in p.stderr and "Traceback" not in p.stderr
    p = script("--version")
    assert p.returncode == 0 and __version__ in p.stdout


def test_progress_only_on_a_terminal_without_json():
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            assert Output(stderr=tty).show_progress
            assert not Output(stderr=tty, json_mode=True).show_progress
            assert not Output(stderr=tty, progress=False).show_progress
            bar = Output(stderr=tty).progress()
            bar.start(100, "verify")
            bar.advance(50)
            bar.close()
    finally:
        os.close(master)
        os.close(slave)
    assert not Output(stderr=io.StringIO()).show_progress
    from goodput_ckpt.tools._common import NO_PROGRESS

    assert Output(stderr=io.StringIO()).progress() is NO_PROGRESS


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("64KiB") == 65536 and parse_size("1024") == 1024
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


def test_readme_command_line_examples_run(tmp_path, monkeypatch):
    """The README's command-line block runs as written (paths moved into a temporary directory)."""
    import re
    import shlex

    from goodput_ckpt import CheckpointManager

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Command line", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, flags=re.S).group(1)
    mgr = CheckpointManager(str(tmp_path / "run"), async_save=False)
    try:
        mgr.save(99, model=torch.nn.Linear(16, 1))
    finally:
        mgr.close()
    monkeypatch.chdir(tmp_path)
    lines = [line.split("  #")[0].strip() for line in block.strip().splitlines()]
    assert len(lines) == 5
    for line in lines:
        argv = shlex.split(line.replace("/tmp/", f"{tmp_path}/"))
        assert argv[0] == "goodput-ckpt"
        code, out, err = run(*argv[1:])
        assert code == 0, (line, out, err)
    assert (tmp_path / "hf_model" / "model.safetensors").exists() and (tmp_path / "w8" / MANIFEST_NAME).exists()
    # A manager checkpoint exports as a model: its own names, no optimizer/RNG sections.
    data = (tmp_path / "hf_model" / "model.safetensors").read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert set(header) - {"__metadata__"} == {"weight", "bias"}


def test_every_command_is_also_a_library_function():
    import goodput_ckpt.tools as tools

    for name in tools.__all__:
        assert callable(getattr(tools, name)), name
        assert callable(getattr(tools, name)), f"{name}: a second lookup found a module"


def test_credentials_in_a_uri_appear_in_no_output(sample_ckpt):
    """``verify``/``ls --json`` on URIs with ``user:secret@``: the secret is in no report, error or
    message (before: echoed in the error and in ``uri``/``root`` of the JSON)."""
    from goodput_ckpt.storage import open_store

    secret = "Sup3rSecretValue"
    root = f"memory://user:{secret}@cli-redact/run"
    store = open_store(f"{root}/step_00000100")
    for path in sorted(Path(sample_ckpt[0]).rglob("*")):
        if path.is_file():
            store.put_commit_record(path.relative_to(sample_ckpt[0]).as_posix(), path.read_bytes(), replace=True)
    code, out, err = run("verify", f"{root}/step_00000100", "--json")
    assert code == EXIT_OK and json.loads(out)["status"] == "ok", out + err
    assert secret not in out + err and "***@cli-redact" in out
    code, out, err = run("ls", root, "--json")
    assert code == EXIT_OK and [c["status"] for c in json.loads(out)["checkpoints"]] == ["complete"], out + err
    assert secret not in out + err
    for argv in (("verify", f"s3://AKID:{secret}@bucket/x", "--json"), ("ls", f"s3://AKID:{secret}@bucket/x")):
        code, out, err = run(*argv)
        assert code == EXIT_USAGE and secret not in out + err and "credentials" in out + err
