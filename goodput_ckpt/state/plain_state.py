"""torch's ``get_state_dict`` result for modules that no wrapper changes, without its walk.

Why: ``torch.distributed.checkpoint.state_dict.get_state_dict`` maps every parameter and
buffer name to its canonical name (``_get_fqns``: a string split and an attribute walk per
name, three times per parameter) so that DDP, FSDP, ``torch.compile`` and activation
checkpointing wrappers give the names of the unwrapped model. A LoRA fine-tune saves a whole
frozen base whose bytes an incremental save does not write, but that walk still runs over all
of it: about 4.9 ms per save for a 4-layer GPT-2 (60 parameters; ``model.state_dict()`` alone
takes 0.18 ms), more than the rest of an incremental save's own per-tensor work (issue 40,
docs/benchmarks.md "Incremental saves"). For a module that no wrapper touches every canonical
name is the name itself, so the result is ``model.state_dict()`` and the optimizers' state
dicts with parameter positions replaced by ``named_parameters()`` names, which is what torch
computes then.

When: only with the default ``StateDictOptions`` and only where :func:`_walk` finds no wrapper
(DDP, FSDP of either kind, ``torch.compile``'s ``OptimizedModule``, a checkpoint wrapper, a
composable API such as ``replicate``, a module with ``_fqn_modifiers``), no DTensor or
ShardedTensor parameter or buffer, and a ``state_dict`` torch has not patched. Every optimizer
must hold state already: torch gives an optimizer without state a zero-gradient step first,
which this path leaves to torch. Anything else falls back to torch.

How it stays the same as torch's: the first call for a model (and after any change of its
shape) runs torch's ``get_state_dict`` and compares the fast result with it, key by key and
object by object (:func:`_same`); only a model that passed is served by the fast path later.
What passed is remembered per model (:data:`_shapes`, weakly) with the identity of every
submodule, parameter and buffer in its tree, and each later call checks them all (a few
microseconds of ``is`` comparisons) and that ``model.state_dict()`` gives the same keys;
a new, removed or replaced module, parameter or buffer, a swapped class (``fully_shard``) or a
composable API applied since sends the call to torch again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_WRAPPED_MODULE
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

__all__ = ["model_and_optim_state"]

_STATE, _GROUPS, _PARAMS = "state", "param_groups", "params"

#: Wrappers whose presence changes names or the state dict's calls: torch's path handles them.
_WRAPPERS: tuple[type, ...] = (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)


def _compiled_type() -> tuple[type, ...]:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a build without dynamo has no compiled modules either
        return ()
    return (OptimizedModule,)


_WRAPPERS += _compiled_type()


@dataclass
class _Shape:
    """A model's tree as the fast path was checked against torch on: per module, a weak
    reference, its class and the identity of each entry of its ``_modules``, ``_parameters``
    and ``_buffers`` tables; the state dict's keys; parameter ``id`` -> the name torch gives it
    in optimizer state (the first of ``named_parameters()``; valid while the tree is the same,
    which keeps every parameter alive)."""

    modules: list[tuple[Any, type, tuple[tuple[int, tuple[tuple[str, Any], ...]], ...]]]
    keys: tuple[str, ...]
    names: dict[int, str]
    checked: bool = False


#: model -> its shape. Weak keys, and values hold no strong reference to any module or tensor
#: (weak references only), so remembering a model never keeps it alive.
_shapes: weakref.WeakKeyDictionary[nn.Module, _Shape] = weakref.WeakKeyDictionary()


def model_and_optim_state(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> tuple[dict, Any]:
    """``get_state_dict(module, optimizers)`` (``get_model_state_dict(module)`` and ``None``
    without optimizers) with the default options: the same keys, the same tensors and the
    same optimizer state objects, computed without torch's name walk where that is safe (the
    module doc)."""
    shape = _shapes.get(module)
    if shape is not None and shape.checked and _unchanged(shape):
        fast = _fast(module, optimizers, shape)
        if fast is not None:
            return fast
    ours = _torch(module, optimizers)
    shape = _walk(module)
    if shape is None:
        _shapes.pop(module, None)
        return ours
    fast = _fast(module, optimizers, shape)
    shape.checked = fast is not None and _same(fast, ours)
    _shapes[module] = shape
    return ours


def _torch(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> tuple[dict, Any]:
    if optimizers:
        return get_state_dict(module, optimizers)
    return get_model_state_dict(module), None


def _fast(module: nn.Module, optimizers: list[torch.optim.Optimizer], shape: _Shape) -> tuple[dict, Any] | None:
    """The state dicts built directly, or ``None`` when this call must go to torch."""
    if "state_dict" in module.__dict__:  # patched by torch's _patch_model_state_dict
        return None
    if any(not o.state or "state_dict" in o.__dict__ for o in optimizers):
        return None  # torch initializes an optimizer without state (a zero-gradient step)
    with torch.no_grad():
        msd = module.state_dict()
    if not msd or tuple(msd) != shape.keys:  # a state-dict hook or extra state changed it
        return None
    if not optimizers:
        return msd, None
    out: dict[str, Any] = {_STATE: {}, _GROUPS: []}
    for opt in optimizers:
        params = list(chain.from_iterable(g[_PARAMS] for g in opt.param_groups))
        try:
            names = [shape.names[id(p)] for p in params]
        except KeyError:
            return None  # a parameter not in the model: torch raises, and says why
        if len(set(names)) != len(names):
            return None  # one parameter twice: torch's position mapping differs then
        osd = opt.state_dict()
        state = osd[_STATE]
        for pid in list(state):  # the order torch leaves them in
            state[names[pid]] = state.pop(pid)
        for group in osd[_GROUPS]:
            group[_PARAMS] = [names[pid] for pid in group[_PARAMS]]
        out[_STATE].update(state)
        out[_GROUPS].extend(osd[_GROUPS])
    return msd, out


def _walk(module: nn.Module) -> _Shape | None:
    """The model's shape, or ``None`` where a wrapper or a distributed tensor means torch's
    path (the module doc)."""
    if "state_dict" in module.__dict__:
        return None
    modules = []
    for prefix, m in module.named_modules():
        if isinstance(m, _WRAPPERS) or REGISTRY_KEY in m.__dict__ or hasattr(m, "_fqn_modifiers"):
            return None
        if _CHECKPOINT_WRAPPED_MODULE in prefix:
            return None
        entries = []
        for which, table in enumerate((m._modules, m._parameters, m._buffers)):
            if any(isinstance(v, (DTensor, ShardedTensor)) for v in table.values()):
                return None
            entries.append((which, tuple((k, _ref(v)) for k, v in table.items())))
        modules.append((weakref.ref(m), type(m), tuple(entries)))
    with torch.no_grad():
        keys = tuple(module.state_dict())
    names: dict[int, str] = {}
    for name, p in module.named_parameters():
        names.setdefault(id(p), name)
    return _Shape(modules=modules, keys=keys, names=names)


def _unchanged(shape: _Shape) -> bool:
    """Whether every module, parameter and buffer of the tree is still the one checked."""
    for ref, cls, entries in shape.modules:
        m = ref()
        if m is None or type(m) is not cls or REGISTRY_KEY in m.__dict__:
            return False
        for which, items in entries:
            table = (m._modules, m._parameters, m._buffers)[which]
            if len(table) != len(items):
                return False
            for k, r in items:
                if k not in table or table[k] is not r():
                    return False
    return True


def _ref(value: Any) -> Any:
    return _none if value is None else weakref.ref(value)


def _none() -> None:
    return None


def _same(fast: tuple[dict, Any], ours: tuple[dict, Any]) -> bool:
    """Whether the fast result is torch's: the same keys in the same order, tensors viewing
    the same memory the same way, and the same optimizer state objects and group entries."""
    (fm, fo), (tm, to) = fast, ours
    if list(fm) != list(tm) or not all(_same_value(fm[k], tm[k]) for k in tm):
        return False
    if (fo is None) != (to is None):
        return False
    if fo is None:
        return True
    if list(fo[_STATE]) != list(to[_STATE]) or any(fo[_STATE][k] is not to[_STATE][k] for k in to[_STATE]):
        return False
    if len(fo[_GROUPS]) != len(to[_GROUPS]):
        return False
    for a, b in zip(fo[_GROUPS], to[_GROUPS]):
        if list(a) != list(b) or a[_PARAMS] != b[_PARAMS]:
            return False
        if any(a[k] is not b[k] for k in b if k != _PARAMS):
            return False
    return True


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and type(a) is type(b)
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset()
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.dtype == b.dtype
            and a.requires_grad == b.requires_grad
        )
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an extra state whose == does not give one bool: not provably the same
        return False
