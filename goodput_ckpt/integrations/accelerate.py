"""Hugging Face Accelerate: ``save_state(accelerator, uri)`` and ``load_state(accelerator, uri)``,
the counterparts of ``Accelerator.save_state``/``load_state`` in goodput-ckpt's format. Needs the
``accelerate`` package, imported only here: ``import goodput_ckpt`` does not import it.

Why functions and not the Accelerator's hooks: ``register_save_state_pre_hook`` and
``register_load_state_pre_hook`` only see the models' weights (a hook may take them out of what
``save_state`` writes); the optimizers, schedulers, dataloader positions, gradient scaler, RNG
states and registered objects are still written by Accelerate with ``torch.save`` and pickle,
into a local directory. So these functions save what ``Accelerator.save_state`` saves, from the
same lists it reads (``accelerator._models``, ``_optimizers``, ``_schedulers``,
``_dataloaders``, ``_custom_objects``: no public accessor exists), as one checkpoint location
in our format: tensors as raw bytes hashed with blake3, the rest as JSON in the manifest
(:mod:`._tree`), on any store (a local path, a mounted volume, ``s3://``).

What is saved, in the order ``Accelerator.save_state`` keeps it: each prepared model's state
dict (as ``accelerator.get_state_dict(model, unwrap=False)``), each optimizer's and scheduler's
state, each dataloader's position when it is a stateful one
(``DataLoaderConfiguration(use_stateful_dataloader=True)``, the only kind whose position
Accelerate saves), the gradient scaler, ``accelerator.step`` (the gradient-accumulation
counter), the state of each object given to ``register_for_checkpointing``, and the RNG streams
of every process (Python, NumPy, torch, CUDA), by process index.

Every process calls both functions. The main process writes (after gathering the RNG states);
every process reads the checkpoint on load. DeepSpeed, FSDP, Megatron-LM and XLA are refused:
Accelerate saves their state through their own engines.
"""

from __future__ import annotations

import os
from typing import Any

from accelerate.data_loader import SeedableRandomSampler, get_sampler
from accelerate.utils import DistributedType

from ..errors import CheckpointError
from ..state.rng import capture_rng
from ._processes import gather_per_process, load_into, restore_process_rng
from ._tree import check_tree_kind, load_tree, save_tree

__all__ = ["CHECKPOINT_KIND", "load_state", "save_state"]

#: What the checkpoint's tree says it is, and the layout version of that tree.
CHECKPOINT_KIND = "accelerate.Accelerator"
_VERSION = 1
_SUPPORTED = (
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_XPU,
)


def _check_supported(accelerator: Any) -> None:
    if accelerator.distributed_type not in _SUPPORTED:
        raise CheckpointError(
            f"goodput-ckpt's Accelerate save_state/load_state do not support {accelerator.distributed_type}: "
            "Accelerate saves its state through that engine's own checkpoint functions"
        )


def save_state(accelerator: Any, uri: str | os.PathLike, *, thread_count: int | None = None, **options: Any) -> str:
    """Save what ``accelerator.save_state`` saves at ``uri`` (replacing a checkpoint of ours
    there). Every process calls this; all return once the main process has committed it.

    Args:
        accelerator: the ``Accelerator`` whose prepared objects are saved.
        uri: the checkpoint location (a local path, a volume path, ``s3://bucket/prefix``).
        thread_count: writer threads (the writer's default).
        **options: backend options (``endpoint_url=...`` for S3, ``volume=True``, ...; see
            :class:`~goodput_ckpt.CheckpointWriter`).

    Returns:
        ``uri``, as a string.

    Raises:
        CheckpointError: the save failed (nothing is committed at ``uri``), or the Accelerator
            runs DeepSpeed, FSDP, Megatron-LM or XLA.
    """
    _check_supported(accelerator)
    uri = os.fspath(uri)
    rngs = gather_per_process(capture_rng())
    if accelerator.is_main_process:
        scaler = accelerator.scaler
        tree = {
            "kind": CHECKPOINT_KIND,
            "version": _VERSION,
            "models": [accelerator.get_state_dict(m, unwrap=False) for m in accelerator._models],
            "optimizers": [o.state_dict() for o in accelerator._optimizers],
            "schedulers": [s.state_dict() for s in accelerator._schedulers],
            "dataloaders": [_loader_state(d) for d in accelerator._dataloaders],
            "scaler": scaler.state_dict() if scaler is not None else None,
            "step": int(accelerator.step),
            "custom": [obj.state_dict() for obj in accelerator._custom_objects],
            "rng": rngs,
        }
        save_tree(tree, uri, thread_count=thread_count, **options)
    accelerator.wait_for_everyone()  # no process loads or saves again before the commit
    return uri


def load_state(
    accelerator: Any, uri: str | os.PathLike, *, verify: bool = True, thread_count: int | None = None, **options: Any
) -> None:
    """Load what :func:`save_state` saved at ``uri`` into ``accelerator``'s prepared objects,
    and set this process's RNG streams. Every process calls this (each reads the checkpoint).

    The checkpoint must hold as many models, optimizers, schedulers, dataloaders and registered
    objects as the Accelerator has prepared now (the same rule as ``Accelerator.load_state``).

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``uri``.
        CorruptCheckpointError: a damaged file (named) or record.
        CheckpointError: not a checkpoint :func:`save_state` wrote, a count that does not match,
            a model whose keys or shapes differ, or an unsupported distributed type.
    """
    _check_supported(accelerator)
    uri = os.fspath(uri)
    tree = load_tree(uri, verify=verify, thread_count=thread_count, **options)
    _check_tree(tree, uri, accelerator)
    for i, (model, state) in enumerate(zip(accelerator._models, tree["models"])):
        load_into(model, state, f"model {i}", uri, strict=True)
    for i, (opt, state) in enumerate(zip(accelerator._optimizers, tree["optimizers"])):
        load_into(opt, state, f"optimizer {i}", uri)
    for i, (sched, state) in enumerate(zip(accelerator._schedulers, tree["schedulers"])):
        load_into(sched, state, f"scheduler {i}", uri)
    for loader, state in zip(accelerator._dataloaders, tree["dataloaders"]):
        _load_loader_state(loader, state, uri)
    if tree["scaler"] is not None and accelerator.scaler is not None:
        load_into(accelerator.scaler, tree["scaler"], "scaler", uri)
    for i, (obj, state) in enumerate(zip(accelerator._custom_objects, tree["custom"])):
        load_into(obj, state, f"registered object {i}", uri)
    accelerator.step = tree["step"]
    restore_process_rng(tree["rng"], accelerator.process_index, accelerator.num_processes, uri)


def _loader_state(loader: Any) -> dict[str, Any]:
    """A prepared dataloader's position: the stateful loader's own state (batches yielded in
    this epoch, its sampler's state) and, for a ``SeedableRandomSampler``, the epoch and seed
    its order comes from (Accelerate's own ``save_state`` keeps these only for iterable
    datasets; without them a resumed epoch fast-forwards through another permutation)."""
    out: dict[str, Any] = {"state": loader.state_dict() if getattr(loader, "use_stateful_dataloader", False) else None}
    sampler = get_sampler(loader) if hasattr(loader, "sampler") else None
    if isinstance(sampler, SeedableRandomSampler):
        out["sampler"] = {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
    return out


def _load_loader_state(loader: Any, saved: Any, uri: str) -> None:
    if not isinstance(saved, dict):
        raise CheckpointError(f"{uri}: a saved dataloader state is not a mapping", path=uri, key="dataloaders")
    sampler_state = saved.get("sampler")
    if sampler_state is not None:
        if not isinstance(sampler_state, dict) or not all(
            type(sampler_state.get(k)) is int for k in ("epoch", "initial_seed")
        ):
            raise CheckpointError(f"{uri}: a saved sampler position is not two integers", path=uri, key="dataloaders")
        sampler = get_sampler(loader) if hasattr(loader, "sampler") else None
        if not isinstance(sampler, SeedableRandomSampler):
            raise CheckpointError(
                f"{uri}: the checkpoint holds a seedable sampler's position and the prepared dataloader has "
                f"{type(sampler).__name__} (use_seedable_sampler differs from the saving run)",
                path=uri,
                key="dataloaders",
            )
        sampler.set_epoch(sampler_state["epoch"])
        sampler.initial_seed = sampler_state["initial_seed"]
    if saved.get("state") is not None and getattr(loader, "use_stateful_dataloader", False):
        load_into(loader, saved["state"], "dataloader", uri)


def _check_tree(tree: Any, uri: str, accelerator: Any) -> None:
    check_tree_kind(tree, uri, kind=CHECKPOINT_KIND, version=_VERSION, layout="Accelerate")
    for key, have in (
        ("models", accelerator._models),
        ("optimizers", accelerator._optimizers),
        ("schedulers", accelerator._schedulers),
        ("dataloaders", accelerator._dataloaders),
        ("custom", accelerator._custom_objects),
    ):
        saved = tree.get(key)
        if not isinstance(saved, list) or len(saved) != len(have):
            count = len(saved) if isinstance(saved, list) else "no list of"
            raise CheckpointError(
                f"{uri} holds {count} {key} and the Accelerator has {len(have)} prepared (or registered): "
                "load into the same set of objects that was saved",
                path=uri,
                key=key,
            )
    if type(tree.get("step")) is not int:
        raise CheckpointError(f"{uri}: the saved accelerator step is not an integer", path=uri, key="step")
