"""Where ``convert --to torch`` spent 1.4 s on 128 bytes (issue 35, item 7).

The writer laid the archive out on fake tensors, and ``FakeTensorMode()`` imports
``torch._dynamo``: 1.4 s on a quiet machine, 2.5-3.7 s on the loaded development one, the whole
time of a small conversion. Small sources now use untouched ``torch.empty`` placeholders, which
``skip_data`` never reads; large ones keep fake tensors. Both give the same archive layout and
values (the pickles differ only in memoizing the device string, and every ``torch.save`` writes
its own serialization id).
"""

from __future__ import annotations

import subprocess
import sys

import torch

from goodput_ckpt.tools._formats import torch_file
from goodput_ckpt.tools.ops.convert import convert_checkpoint


def test_a_small_conversion_does_not_import_dynamo(tmp_path):
    torch.save({"w": torch.arange(32.0), "opt": {"state": {0: {"m": torch.ones(2)}}}}, tmp_path / "a.pt")
    convert_checkpoint(str(tmp_path / "a.pt"), str(tmp_path / "g"), to="goodput")
    code = (
        "import sys; from goodput_ckpt.tools.ops.convert import convert_checkpoint; "
        f"convert_checkpoint({str(tmp_path / 'g')!r}, {str(tmp_path / 'b.pt')!r}, to='torch'); "
        "print('torch._dynamo' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"
    back = torch.load(tmp_path / "b.pt", weights_only=True)
    assert torch.equal(back["w"], torch.arange(32.0)) and list(back["opt"]["state"]) == [0]


def test_real_and_fake_placeholders_give_the_same_archive(tmp_path, monkeypatch):
    sd = {
        "a": torch.randn(5, 3),
        "b": torch.arange(7, dtype=torch.int16),
        "c": {"d": torch.ones((), dtype=torch.bfloat16)},
        "n": 3,
    }
    torch.save(sd, tmp_path / "src.pt")
    convert_checkpoint(str(tmp_path / "src.pt"), str(tmp_path / "g"), to="goodput")
    convert_checkpoint(str(tmp_path / "g"), str(tmp_path / "real" / "x.pt"), to="torch")
    monkeypatch.setattr(torch_file, "REAL_PLACEHOLDER_BYTES", -1)  # every source counts as large
    convert_checkpoint(str(tmp_path / "g"), str(tmp_path / "fake" / "x.pt"), to="torch")
    import zipfile

    layouts = []
    for which in ("real", "fake"):
        with zipfile.ZipFile(tmp_path / which / "x.pt") as z:
            layouts.append([(i.filename, i.file_size, i.header_offset) for i in z.infolist() if "/data/" in i.filename])
    assert layouts[0] == layouts[1] and len(layouts[0]) == 3
    real, fake = (torch.load(tmp_path / w / "x.pt", weights_only=True) for w in ("real", "fake"))
    assert real.keys() == fake.keys() == sd.keys() and real["n"] == fake["n"] == 3
    for k in ("a", "b"):
        assert (
            real[k].dtype == fake[k].dtype == sd[k].dtype
            and torch.equal(real[k], sd[k])
            and torch.equal(fake[k], sd[k])
        )
    assert torch.equal(real["c"]["d"], fake["c"]["d"])


def test_which_placeholders():
    from torch._subclasses.fake_tensor import FakeTensorMode

    small = [torch_file.TensorMeta("w", torch.float32, (4,))]
    big = [torch_file.TensorMeta("w", torch.uint8, (torch_file.REAL_PLACEHOLDER_BYTES + 1,))]
    assert not isinstance(torch_file._placeholder_mode(small), FakeTensorMode)
    assert isinstance(torch_file._placeholder_mode(big), FakeTensorMode)
    torch.use_deterministic_algorithms(True)
    try:  # torch.empty would fill its memory: no real placeholders then
        assert isinstance(torch_file._placeholder_mode(small), FakeTensorMode)
    finally:
        torch.use_deterministic_algorithms(False)
