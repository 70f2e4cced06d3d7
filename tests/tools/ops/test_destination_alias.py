"""``reshard``/``convert`` never write into their source (hostile-inputs issue, item 2).

The destination can name the source without spelling it the same way: a symbolic link to it, a
bind mount, ``src/../src``, a directory inside it. With ``overwrite`` such a destination used to
have the source's files deleted and rewritten. Each spelling is refused before anything is
written, and the source still verifies afterwards.
"""

from __future__ import annotations

import os

import pytest
from helpers.samples import save

from goodput_ckpt.tools.ops.convert import convert_checkpoint
from goodput_ckpt.tools.ops.reshard import reshard_checkpoint
from goodput_ckpt.tools.ops.verify import verify_checkpoint


def _listing(path):
    return sorted((p, os.path.getsize(os.path.join(path, p))) for p in os.listdir(path))


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "src"
    save(path)
    return path


def _aliases(src, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(src, target_is_directory=True)
    return {
        "symlink": str(link),
        "dotdot": f"{src}/../{src.name}",
        "trailing slash": f"{src}/",
        "file URL": f"file://{src}",
        "inside": str(src / "nested"),
        "contains": str(tmp_path),
    }


@pytest.mark.parametrize("alias", ["symlink", "dotdot", "trailing slash", "file URL", "inside", "contains"])
def test_reshard_refuses_an_alias_of_its_source(src, tmp_path, alias):
    before = _listing(src)
    with pytest.raises(ValueError, match="must differ from the source"):
        reshard_checkpoint(str(src), _aliases(src, tmp_path)[alias], world_size=2, overwrite=True)
    assert _listing(src) == before
    assert verify_checkpoint(str(src)).ok


@pytest.mark.parametrize("to", ["goodput", "dcp", "safetensors"])
@pytest.mark.parametrize("alias", ["symlink", "dotdot", "inside"])
def test_convert_refuses_an_alias_of_its_source(src, tmp_path, alias, to):
    before = _listing(src)
    with pytest.raises(ValueError, match="must differ from the source"):
        convert_checkpoint(str(src), _aliases(src, tmp_path)[alias], to=to, overwrite=True)
    assert _listing(src) == before
    assert verify_checkpoint(str(src)).ok


def test_convert_refuses_a_linked_file_of_its_source(tmp_path):
    """A single-file source (torch) written over through a link to it."""
    import torch

    pt = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3)}, pt)
    (tmp_path / "alias.pt").symlink_to(pt)
    before = pt.read_bytes()
    with pytest.raises(ValueError, match="must differ from the source"):
        convert_checkpoint(str(pt), str(tmp_path / "alias.pt"), to="torch", overwrite=True)
    assert pt.read_bytes() == before


def test_bind_mount_alias_is_refused(src, tmp_path):
    """Same device and inode, no link on the way: only an inode comparison can see it."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or os.system(f"mount --bind {src} {mnt} 2>/dev/null") != 0:
        pytest.skip("bind mounts need root and mount(8)")
    try:
        with pytest.raises(ValueError, match="must differ from the source"):
            reshard_checkpoint(str(src), str(mnt), world_size=2, overwrite=True)
    finally:
        os.system(f"umount {mnt}")
    assert verify_checkpoint(str(src)).ok


def test_siblings_are_not_aliases(src, tmp_path):
    report = reshard_checkpoint(str(src), str(tmp_path / "src2"), world_size=2, rank_state="keep")
    assert verify_checkpoint(report.dst).ok
