"""A fresh optimizer's state, shaped from the checkpoint a restore loads, instead of made by a step.

torch's ``get_state_dict`` needs an optimizer's state to exist before DCP can load into it, so
for a fresh optimizer it runs ``optimizer.step()`` once with zero gradients and ``lr=0``
(``_init_optim_state``). That step allocates and zero-fills every state tensor and then runs the
optimizer's arithmetic over all of them: for AdamW on 320 MiB of parameters it took 0.64-0.70 s
on the development machine, where allocating the same state took 0.16-0.17 s zero-filled and
0.3 ms uninitialized (``benchmarks/probe_optim_init.py``, 5 repeats). A restore then overwrites every byte of it.

Here a restore into a fresh optimizer creates the state it is about to load, shaped as the
checkpoint saved it: for each parameter, each saved state tensor of the parameter's shape is
``empty_like(param)`` in the saved dtype (a DTensor with the parameter's placement under FSDP2),
and a saved scalar ``step`` a 0-dim CPU tensor (``Optimizer.load_state_dict`` moves it where a
fused or capturable optimizer keeps it). No byte of it survives the load: the manifest's chunks
tile every tensor (``format/tiling.py``), so the load writes all of it.

Anything this does not recognise keeps torch's way (:func:`preshape` returns ``False`` and
leaves the optimizer as it was): an optimizer that already has state or gradients, a trainable
parameter without saved state, a saved state value that is not a tensor, or a tensor of another
shape (factored or preconditioner states). ``get_state_dict``'s result is then compared with the
checkpoint's keys, and on any difference the state made here is removed again, so torch's own
initialization runs as before (:func:`matches`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..format.dcp_metadata import torch_dtype
from ..format.schema import Manifest, TensorEntry

__all__ = ["clear", "matches", "preshape", "saved_states"]

#: The one 0-dim state created here: optimizers keep their step count in it.
STEP = "step"


def saved_states(manifest: Manifest, prefix: str) -> dict[str, dict[str, TensorEntry | None]]:
    """The saved optimizer state under ``prefix`` (``"optimizer.state."``): parameter FQN ->
    state name -> its tensor entry (``None`` for a value that is not a tensor)."""
    out: dict[str, dict[str, TensorEntry | None]] = {}
    for key, entry in manifest.items.items():
        if key.startswith(prefix):
            fqn, _, name = key[len(prefix) :].rpartition(".")
            if fqn:
                out.setdefault(fqn, {})[name] = entry if isinstance(entry, TensorEntry) else None
    return out


def preshape(
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    saved: Mapping[str, Mapping[str, TensorEntry | None]],
) -> bool:
    """Create the state of fresh ``optimizers`` from ``saved`` (module docstring); ``False``, and
    nothing changed, where torch's initialization must run instead."""
    if not saved or any(opt.state for opt in optimizers):
        return False
    fqn_of = _fqns(module)
    if fqn_of is None:
        return False
    made: list[tuple[torch.optim.Optimizer, torch.Tensor, dict[str, torch.Tensor]]] = []
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    return False  # torch's initialization would not run either
                if not p.requires_grad:
                    continue
                states = saved.get(fqn_of.get(id(p), ""))
                state = _state_for(p, states) if states else None
                if state is None:
                    return False
                made.append((opt, p, state))
    for opt, p, state in made:
        opt.state[p] = state
    return bool(made)


def matches(osd: Mapping[str, Any], saved: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether ``get_state_dict``'s optimizer state names exactly the saved parameters and state
    names (the check that the FQNs used here are torch's)."""
    state = osd.get("state")
    if not isinstance(state, Mapping) or state.keys() != saved.keys():
        return False
    return all(isinstance(v, Mapping) and v.keys() == saved[k].keys() for k, v in state.items())


def clear(optimizers: list[torch.optim.Optimizer]) -> None:
    """Remove state made by :func:`preshape` (the optimizers had none before it)."""
    for opt in optimizers:
        opt.state.clear()


def _state_for(p: torch.Tensor, states: Mapping[str, TensorEntry | None]) -> dict[str, torch.Tensor] | None:
    out: dict[str, torch.Tensor] = {}
    shape = tuple(p.shape)  # a DTensor's global shape
    for name, entry in states.items():
        if entry is None:
            return None
        try:
            dtype = torch_dtype(entry.dtype, name)
        except Exception:  # noqa: BLE001 - an unknown dtype: let torch's way meet it
            return None
        if name == STEP and tuple(entry.shape) == ():  # first: a 0-dim parameter's step is no copy of it
            out[name] = torch.zeros((), dtype=dtype)
        elif tuple(entry.shape) == shape:
            out[name] = torch.empty_like(p, dtype=dtype, requires_grad=False)
        else:
            return None
    return out


def _fqns(module: torch.nn.Module) -> dict[int, str] | None:
    """id(parameter) -> the FQN torch's state-dict helpers give it, or ``None`` where that cannot
    be told (torch's helper missing, or a parameter with several FQNs, as FSDP1's flat ones)."""
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns
    except ImportError:
        return None
    out: dict[int, str] = {}
    try:
        for name, p in module.named_parameters():
            fqns = _get_fqns(module, name)
            if len(fqns) != 1:
                return None
            out[id(p)] = next(iter(fqns))
    except Exception:  # noqa: BLE001 - a layout torch's helper does not know: torch's way
        return None
    return out
