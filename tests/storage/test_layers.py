"""House rule 1: the storage layer (and the format's schema) never import torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_storage_and_manifest_import_without_torch():
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
        sys.meta_path.insert(0, Block())
        import importlib, pkgutil
        import goodput_ckpt
        import goodput_ckpt.storage
        import goodput_ckpt.format.manifest
        import goodput_ckpt.format.commit_record
        import goodput_ckpt.errors
        # Every store module, present and future (local, volume, staging, S3, fsspec ...).
        for m in pkgutil.iter_modules(goodput_ckpt.storage.__path__):
            importlib.import_module(f"goodput_ckpt.storage.{m.name}")
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_public_api_matches_design():
    import goodput_ckpt

    expected = {
        "CheckpointWriter",
        "CheckpointReader",
        "CheckpointError",
        "IncompleteCheckpointError",
        "CorruptCheckpointError",
        "CheckpointExistsError",
        "CheckpointNotFoundError",
    }
    assert expected <= set(goodput_ckpt.__all__)
    for name in goodput_ckpt.__all__:
        assert getattr(goodput_ckpt, name) is not None
    for sub in ("IncompleteCheckpointError", "CorruptCheckpointError", "CheckpointExistsError", "CheckpointNotFoundError"):
        assert issubclass(getattr(goodput_ckpt, sub), goodput_ckpt.CheckpointError)
    assert issubclass(goodput_ckpt.CheckpointError, Exception)
