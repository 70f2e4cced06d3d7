"""Subprocess half of the SIGKILL tests (test_sigkill.py): save one checkpoint, to be killed.

Usage::

    python save_worker.py LOCATION VERSION [--overwrite] [--mib N]

Builds the deterministic state dict of ``VERSION`` (see :func:`versioned_state`), prints ``READY`` once
it is built (the parent times its kill from there, so interpreter start-up is not counted), saves
it with ``dcp.save`` and ``CheckpointWriter``, then prints ``SAVED <seconds>``. The parent SIGKILLs
it at a random moment, or lets it finish (the calibration run).

This file is a plain script, not a test module; test_sigkill.py imports :func:`layout` and
:func:`expected_tensor` from it so both sides agree on the values.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

#: Tensor sizes in elements (float32): ~1-64 MiB tensors plus many small ones, like a model.
_BIG = [16 << 20, 8 << 20, 8 << 20, 4 << 20, 4 << 20, 2 << 20, 1 << 20, 1 << 18]
_SMALL = 64


def layout(mib: int) -> dict[str, int]:
    """Key -> number of float32 elements; the big tensors are scaled to about ``mib`` MiB."""
    total = sum(_BIG) * 4
    scale = (mib << 20) / total
    sizes = {f"model.big{i}": max(1024, int(n * scale)) for i, n in enumerate(_BIG)}
    sizes.update({f"model.small{i}": 257 + 31 * i for i in range(_SMALL)})
    return sizes


def expected_tensor(key: str, numel: int, version: int) -> torch.Tensor:
    """The values of ``key`` in ``version``: cheap to build, different for every key and version."""
    base = (sum(key.encode()) * 131 + version * 1_000_003) % 65_521
    return (torch.arange(numel, dtype=torch.int32).add_(base).remainder_(65_521)).to(torch.float32)


def versioned_state(version: int, mib: int) -> dict[str, object]:
    """Not ``helpers.make_state``: every value follows from its key and ``version`` alone
    (:func:`expected_tensor`), so the parent checks what a killed save left without this state."""
    sd: dict[str, object] = {k: expected_tensor(k, n, version) for k, n in layout(mib).items()}
    sd["step"] = version  # a non-tensor value (stored as an object item)
    return sd


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("location")
    ap.add_argument("version", type=int)
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--mib", type=int, default=256)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp

    from goodput_ckpt import CheckpointWriter

    sd = versioned_state(args.version, args.mib)
    print("READY", flush=True)
    t0 = time.perf_counter()
    dcp.save(sd, storage_writer=CheckpointWriter(args.location, overwrite=args.overwrite))
    print(f"SAVED {time.perf_counter() - t0:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
