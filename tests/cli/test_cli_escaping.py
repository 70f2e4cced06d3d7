"""Keys, file names and messages from a checkpoint never reach a terminal raw: a crafted key
cannot erase the CORRUPT line and print a fake OK."""

from __future__ import annotations

import io
import json

import torch
from helpers.samples import flip_byte, item_range, save

from goodput_ckpt.cli import EXIT_FAILED, main
from goodput_ckpt.cli._output import Output, escape, table

FAKE = "w\x1b[1A\x1b[2K\rOK  all good\u202e"


def run(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def _raw_controls(text: str) -> list[str]:
    return [c for c in text if (ord(c) < 32 and c != "\n") or 0x7F <= ord(c) <= 0x9F or c == "\u202e"]


def test_escape_writes_every_terminal_control_visibly():
    assert escape(FAKE) == "w\\x1b[1A\\x1b[2K\\x0dOK  all good\\u202e"
    assert escape("a\nb") == "a\\x0ab" and escape("a\nb", keep_newlines=True) == "a\nb"
    assert _raw_controls(table(["KEY"], [[FAKE], ["x\ny"]])) == []
    buf = io.StringIO()
    Output(stdout=buf, stderr=buf).print(f"line one {FAKE}\nline two")
    assert _raw_controls(buf.getvalue()) == [] and buf.getvalue().count("\n") == 2


def test_a_crafted_key_cannot_hide_corruption(tmp_path):
    path = tmp_path / "c"
    save(path, {"model": {FAKE: torch.arange(4096.0)}})
    key = next(k for k in json.loads((path / "manifest.json").read_text())["items"] if k.startswith("model.w"))
    f, off, _ = item_range(path, key)
    flip_byte(path, f, off + 8)
    for argv in (("verify", path), ("inspect", path), ("ls", tmp_path)):
        code, out, err = run(*argv)
        assert _raw_controls(out + err) == [], argv
    code, out, _ = run("verify", path)
    assert code == EXIT_FAILED and out.startswith("CORRUPT") and "\\x1b[2K" in out
    code, out, _ = run("verify", path, "--json")
    assert json.loads(out)["problems"][0]["keys"] == [key]
