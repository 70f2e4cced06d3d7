"""Sample checkpoints and damage for the tools' tests (real files, written by dcp.save)."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointWriter
from goodput_ckpt.format import MANIFEST_NAME

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

#: Small hash chunks, so that even small samples span many chunks and several tasks.
CHUNK = 1 << 14


def sample_state(seed: int = 0) -> dict[str, Any]:
    """A model + optimizer + per-rank RNG/dataloader + extra state, with awkward shapes."""
    g = torch.Generator().manual_seed(seed)
    model = {
        "embed.weight": torch.randn(1001, 64, generator=g),  # 1001 rows: uneven over 2 and 3 ranks
        "layer.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "layer.bias": torch.randn(64, generator=g).half(),
        "head.weight": torch.randn(2, 64, generator=g),  # fewer rows than ranks
        "ids": torch.randint(-(2**40), 2**40, (17, 3), generator=g, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
        "scale": torch.tensor(0.125),
        "empty": torch.empty(0, 5),
        "f8": torch.randn(40, 2, generator=g).to(torch.float8_e4m3fn),
    }
    optimizer = {
        "state": {
            "embed.weight": {"exp_avg": torch.randn(1001, 64, generator=g), "step": torch.tensor(7.0)},
        },
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": ["embed.weight"]}],
    }
    return {
        "model": model,
        "optimizer": optimizer,
        "rng": {"rank0": {"cpu": torch.get_rng_state()}},
        "dataloader": {"rank0": torch.arange(100, dtype=torch.uint8)},
        "extra": {"epoch": 3, "name": "run-7"},
    }


def save(path: str | os.PathLike, sd: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    sd = sample_state() if sd is None else sd
    kw.setdefault("chunk_size", CHUNK)
    dcp.save(sd, storage_writer=CheckpointWriter(str(path), **kw))
    return sd


def flat_tensors(sd: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors of a nested state dict under DCP's flattened keys (dicts only)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif isinstance(v, dict):
            out.update(flat_tensors(v, key + "."))
    return out


def manifest(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads(Path(path, MANIFEST_NAME).read_text())


def item_range(path: str | os.PathLike, key: str, chunk: int = 0) -> tuple[str, int, int]:
    """(file, offset, length) of a tensor chunk or object in the checkpoint at ``path``."""
    from goodput_ckpt.format.manifest import TensorEntry, parse_manifest

    item = parse_manifest(Path(path, MANIFEST_NAME).read_bytes()).items[key]
    c = item.chunks[chunk] if isinstance(item, TensorEntry) else item  # a v2 grid expands its cells
    return c.file, c.offset, c.length


def flip_byte(path: str | os.PathLike, name: str, offset: int) -> None:
    with open(Path(path, name), "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def truncate(path: str | os.PathLike, name: str, size: int) -> None:
    os.truncate(Path(path, name), size)


def copy_ckpt(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)


class Opaque:
    """A value only full pickle can load (for --trust-pickle tests)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


class Evil:
    """Pickles to a call of os.system: restricted unpicklers must refuse it, never run it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def rewrite_manifest(path: str | os.PathLike, doc: dict[str, Any]) -> None:
    """Replace the manifest with ``doc``, sealed as the writer seals it (so that only the
    edit under test, not a broken seal, makes it invalid)."""
    from goodput_ckpt.format.manifest import seal_manifest

    body = {k: v for k, v in doc.items() if k != "digest"}
    Path(path, MANIFEST_NAME).write_bytes(seal_manifest(json.dumps(body).encode("utf-8")))


def damaged_manifests(good: bytes) -> dict[str, bytes]:
    """Ways a manifest fails to validate: cut short (a record still being written, or a killed
    save's), sealed but with one edited byte (its own digest fails), and not JSON at all."""
    at = good.index(b'"world_size":') + len(b'"world_size":')
    edited = good[:at] + (b"7" if good[at : at + 1] != b"7" else b"8") + good[at + 1 :]
    return {"truncated": good[: len(good) // 2], "digest": edited, "garbage": b"{"}
