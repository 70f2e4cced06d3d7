"""House rule 1: layers import downward only (docs/architecture.md's list), and the storage layer, the byte
engine (and the format's schema, the manager's root layout, retention and timeline) never import
torch."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import goodput_ckpt

#: The layers of docs/architecture.md's "Layers" block, bottom first: the page is the one home of
#: the list, and this test reads it from there. A module may import its own layer and those below.
_DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _documented_layers() -> list[str]:
    """The names in the first fenced block under "## Layers", top-down there, bottom first here."""
    text = _DOC.read_text().split("## Layers", 1)[1]
    block = text.split("```", 2)[1]
    names = [line.split()[0].rstrip("/") for line in block.splitlines() if line and not line[0].isspace()]
    return names[::-1]


LAYERS = _documented_layers()
#: Top-level modules outside the list: the version sits at the bottom; the package root
#: (``from goodput_ckpt import ...``) re-exports the public API, so only tools/ and cli/ use it.
_RANK = {"_version": 0, "errors": 0, **{name: i for i, name in enumerate(LAYERS)}, "": LAYERS.index("tools")}


def _layer(module: str) -> str:
    """``goodput_ckpt.manager.staging.stager`` -> ``manager``; the package root -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path, module: str, is_package: bool):
    """The ``goodput_ckpt`` modules that ``module`` imports (anywhere in it, lazily too)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "goodput_ckpt")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "goodput_ckpt":
                yield target


def test_the_documented_layers_are_the_packages():
    """The page lists every package of goodput_ckpt (and errors), none twice, and nothing else."""
    root = Path(goodput_ckpt.__file__).parent
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").exists()} | {"errors"}
    assert sorted(LAYERS) == sorted(packages) and len(set(LAYERS)) == len(LAYERS), LAYERS


def test_layers_import_downward_only():
    root = Path(goodput_ckpt.__file__).parent
    assert (root / "manager" / "checkpoint_manager.py").exists()
    upward = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        is_package = rel.name == "__init__"
        module = ".".join(rel.parts[:-1] if is_package else rel.parts)
        if module == "goodput_ckpt":
            continue  # the root's lazy exports are the public API, not a layer
        here = _layer(module)
        assert here in _RANK, f"{module}: a layer docs/architecture.md does not list"
        for target in _imports(path, module, is_package):
            if _RANK[_layer(target)] > _RANK[here]:
                upward.append(f"{module} imports {target}")
    assert not upward, "imports that point upward:\n" + "\n".join(upward)


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
        # What the tools read a root and a timeline with (ls, inspect, plan).
        import goodput_ckpt.manager
        import goodput_ckpt.manager.retention
        import goodput_ckpt.manager.step_layout
        import goodput_ckpt.manager.timeline
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


def test_engine_imports_without_torch():
    """Every module of the byte engine imports with torch unimportable (``sys.modules["torch"] =
    None`` makes any ``import torch`` fail), so the tools and tiers that use it directly need no torch."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None
        import importlib, pkgutil
        import goodput_ckpt.engine
        names = [m.name for m in pkgutil.iter_modules(goodput_ckpt.engine.__path__)]
        for name in names:
            importlib.import_module(f"goodput_ckpt.engine.{name}")
        assert not [m for m, v in sys.modules.items() if v is not None and m.split(".")[0] == "torch"]
        print(len(names))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= 8  # the package was really found and walked
