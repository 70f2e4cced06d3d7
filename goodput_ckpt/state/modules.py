"""Models and optimizers through torch's distributed state-dict helpers.

``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict`` handle plain
modules, DDP and FSDP2 alike and keep FSDP2 parameters and optimizer states as DTensors, so a
sharded model is saved sharded (each rank writes its shard) and reshards on load. Optimizer
state is keyed by parameter names rather than positions.

Accepted shapes::

    model=module,            optimizer=None | opt | [opt, ...] | {name: opt}
    model={name: module},    optimizer=None | {name: opt}    (names a subset of the models')

A dict of optimizers for one model is passed to torch as a list (in the dict's order); its state
is one merged optimizer state dict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from . import optim_state as shaping
from .plain_state import model_and_optim_state

__all__ = ["ModelSet", "normalize", "tied_keys"]


class ModelSet:
    """The models and optimizers of one save or restore, in a checked, uniform shape.

    Attributes:
        named: ``True`` when ``model`` was a dict (the state is then nested by name).
        pairs: name -> (module, optimizers); the name is ``""`` for a single model.
    """

    def __init__(self, named: bool, pairs: dict[str, tuple[torch.nn.Module, list[torch.optim.Optimizer]]]) -> None:
        self.named = named
        self.pairs = pairs
        self._shaped: list[torch.optim.Optimizer] = []  # fresh optimizers given state by state_dicts(saved)

    @property
    def has_optimizer(self) -> bool:
        return any(opts for _, opts in self.pairs.values())

    def describe(self) -> dict[str, Any]:
        """For the manifest: which models and optimizers the state holds."""
        return {
            "models": sorted(self.pairs) if self.named else None,
            "optimizers": sorted(n for n, (_, o) in self.pairs.items() if o) if self.named else None,
        }

    def state_dicts(self, saved: Callable[[str], Mapping[str, Mapping[str, Any]]] | None = None) -> tuple[Any, Any]:
        """``(model_state, optimizer_state)``; the latter is ``None`` without optimizers.

        Tensors in them are the live parameters and states (views, not copies): torch's
        ``get_state_dict`` with the default options, by a faster path for modules no wrapper
        changes (:mod:`.plain_state`). ``saved`` (a
        restore): model name -> the optimizer state the checkpoint holds for it
        (:func:`.optim_state.saved_states`), from which a fresh optimizer's state is made
        instead of by torch's zero-gradient step (:mod:`.optim_state`).
        """
        models: dict[str, Any] = {}
        optims: dict[str, Any] = {}
        for name, (module, optimizers) in self.pairs.items():
            if optimizers:
                shaped = saved is not None and shaping.preshape(module, optimizers, states := saved(name))
                if shaped:
                    self._shaped.extend(optimizers)  # before anything else can raise
                msd, osd = model_and_optim_state(module, optimizers)
                if shaped and not shaping.matches(osd, states):
                    shaping.clear(optimizers)  # not torch's names: torch's initialization instead
                    self._unshaped(optimizers)
                    msd, osd = model_and_optim_state(module, optimizers)
                optims[name] = osd
            else:
                msd, _ = model_and_optim_state(module, [])
            models[name] = msd
        if not self.named:
            return models[""], optims.get("")
        return models, (optims or None)

    def discard_shaped_state(self) -> None:
        """After a restore that failed before :meth:`load`: remove the state :meth:`state_dicts`
        gave fresh optimizers (uninitialized memory where the load did not reach), so they are
        fresh again rather than holding values no step made. Once :meth:`load` applied the
        loaded state, it is kept."""
        shaping.clear(self._shaped)
        self._shaped.clear()

    def load(self, model_state: Any, optim_state: Any) -> None:
        """Apply loaded state dicts (in the shape :meth:`state_dicts` returned)."""
        models = model_state if self.named else {"": model_state}
        optims = (optim_state or {}) if self.named else {"": optim_state}
        opts = StateDictOptions(strict=True)
        for name, (module, optimizers) in self.pairs.items():
            if optimizers:
                set_state_dict(
                    module, optimizers, model_state_dict=models[name], optim_state_dict=optims[name], options=opts
                )
                self._unshaped(optimizers)  # loaded: what they hold is the checkpoint's
            else:
                set_model_state_dict(module, models[name], options=opts)

    def _unshaped(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Forget ``optimizers`` for :meth:`discard_shaped_state`."""
        self._shaped = [o for o in self._shaped if all(o is not x for x in optimizers)]


def normalize(model: Any, optimizer: Any) -> ModelSet:
    """Check the ``model``/``optimizer`` arguments and pair them (see the module doc).

    Raises:
        TypeError: a value of the wrong kind, or optimizer names that are not model names.
    """
    if isinstance(model, torch.nn.Module):
        return ModelSet(False, {"": (model, _optimizer_list(optimizer, "optimizer"))})
    if isinstance(model, Mapping) and model:
        mods: dict[str, torch.nn.Module] = {}
        for name, m in model.items():
            if not isinstance(name, str) or not name or "." in name:
                raise TypeError(f"model names must be non-empty strings without '.', got {name!r}")
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"model[{name!r}] must be an nn.Module, got {type(m).__name__}")
            mods[name] = m
        if optimizer is None:
            optimizer = {}
        if not isinstance(optimizer, Mapping):
            raise TypeError("with a dict of models, optimizer must be None or a dict keyed by model name")
        unknown = sorted(set(optimizer) - set(mods))
        if unknown:
            raise TypeError(f"optimizer names {unknown} are not model names {sorted(mods)}")
        return ModelSet(True, {n: (m, _optimizer_list(optimizer.get(n), f"optimizer[{n!r}]")) for n, m in mods.items()})
    raise TypeError(f"model must be an nn.Module or a non-empty dict of them, got {type(model).__name__}")


def _optimizer_list(value: Any, what: str) -> list[torch.optim.Optimizer]:
    if value is None:
        return []
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    items = list(value.values()) if isinstance(value, Mapping) else value
    if isinstance(items, (list, tuple)) and items and all(isinstance(o, torch.optim.Optimizer) for o in items):
        return list(items)
    raise TypeError(f"{what} must be an Optimizer, a list or a dict of them, got {type(value).__name__}")


def tied_keys(model_state: Any, prefix: str) -> dict[str, str]:
    """``{alias: kept}`` for tensors of ``model_state`` that are the same data (tied weights).

    Why: a tied ``lm_head.weight`` and embedding are one parameter in the model but two keys
    in its state dict, so DCP saves the bytes twice and nothing in the checkpoint says they
    were one. Exporting to Hugging Face safetensors must write them once, as
    ``save_pretrained`` and ``safetensors.torch.save_model`` do, and only the live tensors
    can tell: equal bytes are no proof (two zero-initialised biases are equal and not tied).
    Recorded at save time in the manifest metadata; the first key in state-dict order (the
    embedding, for the usual module order) is kept. Keys are DCP's flattened keys
    (``prefix.a.b``).
    """
    seen: dict[tuple, str] = {}
    out: dict[str, str] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, f"{key}.{k}")
            return
        if not isinstance(value, torch.Tensor):
            return
        # Cheap tests first: this runs per tensor at every save, over a LoRA's whole frozen base
        # (``isinstance(.., DTensor)`` and ``device.type`` cost about 1 us each, ``is_meta`` and
        # ``torch.Size``, a tuple, about 0.05 us).
        local = value.to_local() if type(value) is not torch.Tensor and isinstance(value, DTensor) else value
        if local.is_meta or local.numel() == 0:
            return
        ident = (
            local.untyped_storage().data_ptr(),
            local.storage_offset(),
            local.shape,
            local.stride(),
            local.dtype,
            value.shape,
        )
        if ident in seen:
            out[key] = seen[ident]
        else:
            seen[ident] = key

    walk(model_state, prefix)
    return out
