"""A single-file checkpoint given where a directory is needed (issue 35, item 4).

``reshard`` on a ``.pt`` file printed a raw "Not a directory" and exited 1, where ``inspect`` and
``verify`` exited 2 with a message. Now one detection (``tools._common.refuse_plain_file``) gives
every command the same message, naming the file's type, and exit status 2.
"""

from __future__ import annotations

import io

import pytest
import torch

from goodput_ckpt.cli import EXIT_USAGE, main
from goodput_ckpt.tools.ops.convert import convert_checkpoint

COMMANDS = [
    ["inspect", "{f}"],
    ["verify", "{f}"],
    ["verify", "{f}", "--quick"],
    ["reshard", "{f}", "{out}", "--world-size", "2"],
    ["ls", "{f}"],
    ["ls", "{f}", "--verify"],
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("files")
    torch.save({"w": torch.ones(3)}, base / "a.pt")
    torch.save({"w": torch.ones(3)}, base / "legacy.pt", _use_new_zipfile_serialization=False)
    convert_checkpoint(str(base / "a.pt"), str(base / "m.safetensors"), to="safetensors")
    (base / "notes.txt").write_text("hello")
    return base


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:1] + a[2:3]))
@pytest.mark.parametrize(
    "name, kind",
    [
        ("a.pt", "a torch.save file"),
        ("legacy.pt", "a torch.save file"),
        ("m.safetensors", "a safetensors file"),
        ("notes.txt", "a file"),
    ],
)
def test_every_command_names_the_file_type_and_exits_2(files, tmp_path, argv, name, kind):
    f = files / name
    err = io.StringIO()
    code = main([a.format(f=f, out=tmp_path / "out") for a in argv], stdout=io.StringIO(), stderr=err)
    text = err.getvalue().strip()
    assert code == EXIT_USAGE, text
    assert text == f"goodput-ckpt {argv[0]}: error: {f} is {kind}, not a checkpoint directory" + (
        f"; convert it first: goodput-ckpt convert {f} DST --to goodput" if kind != "a file" else ""
    )
    assert not (tmp_path / "out").exists()
