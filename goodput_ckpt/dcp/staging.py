"""Staging for ``dcp.async_save``: a training-safe CPU copy of the state dict.

:func:`stage_state_dict` copies into fresh memory on every save; it is what
``CheckpointWriter.stage`` uses when ``dcp.async_save`` gets no stager. The manager's stager,
which keeps its buffers across saves, is :class:`goodput_ckpt.manager.staging.stager.ReusableStager`.

``dcp.async_save`` uses the storage writer as its stager when the writer implements torch's
``AsyncStager`` protocol, so callers need not pass one. Staging copies every tensor (CPU or
accelerator) into CPU memory and deep-copies every other value, so parameters mutated after
``async_save`` returns never reach the checkpoint. torch's ``DefaultStager()`` with default
options raises on CPU-only machines; this one works everywhere and pins memory only when CUDA is
available.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError

__all__ = ["PAGE_ALIGN", "aligned_empty", "stage_state_dict"]

#: The alignment of :func:`aligned_empty`'s memory: a page, what ``O_DIRECT`` wants of a buffer's
#: address (``goodput_ckpt.storage.direct_read.ALIGN``; this layer may not import the storage's).
PAGE_ALIGN = 4096
#: Below this many bytes a buffer is a plain ``torch.empty``: the write path bounces small chunks
#: anyway (a chunk of several tensors), and the page of padding would be most of the buffer.
_ALIGNED_MIN_BYTES = 1 << 20


def stage_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of ``state_dict`` whose tensors live in (fresh) CPU memory.

    DTensor and ShardedTensor values keep their wrappers (with CPU local tensors), so DCP still
    plans sharded writes from the staged copy.
    """
    try:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    except ImportError as e:  # pragma: no cover - torch moved its private helpers
        raise CheckpointError(
            f"torch {torch.__version__} lacks the state-dict staging helpers goodput-ckpt uses; "
            "pass an explicit async_stager to dcp.async_save"
        ) from e
    pin = torch.cuda.is_available() and _has_cuda_tensor(state_dict)
    staged = _create_cpu_state_dict(state_dict, pin_memory=pin)
    # type_check=False: values that are not tensors were deep-copied by _create_cpu_state_dict.
    _copy_state_dict(state_dict, staged, type_check=False)
    return staged


def aligned_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose first byte is page-aligned (from 1 MiB on).

    Why: a local save that writes around the page cache (``O_DIRECT``) can write such a buffer
    where it lies; torch's allocator aligns CPU memory to 64 bytes only, so every other buffer is
    first copied into an aligned bounce buffer (27 ms of CPU per 256 MiB on the development
    machine, a quarter of the writer's). The tensor is a view into a slightly larger byte
    storage; nothing in a save reads past its own bytes.
    """
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if nbytes < _ALIGNED_MIN_BYTES or dtype.itemsize > 16 or PAGE_ALIGN % dtype.itemsize:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + PAGE_ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE_ALIGN
    return raw[skip : skip + nbytes].view(dtype).view(shape)


def _has_cuda_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.device.type == "cuda"
    if isinstance(obj, dict):
        return any(_has_cuda_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_cuda_tensor(v) for v in obj)
    return False
