"""A trainer's checkpoint dict (nested dicts, lists, tuples, tensors, numbers) saved through our
format without pickle framing, and read back exactly.

Why a module of its own: trainers (Lightning, and later others) hand their checkpoint hook one
nested Python object, not a DCP state dict. This splits it in two:

- every tensor becomes one item of a flat DCP state dict, written by :class:`CheckpointWriter` as
  raw, hashed bytes, under a readable key made of its path (``state_dict/layer.weight``,
  ``optimizer_states/0/state/0/exp_avg``);
- everything else becomes a JSON *skeleton* stored in the manifest's user metadata (under
  :data:`TREE_KEY`), with the tensors replaced by their keys.

A value JSON cannot hold exactly (a non-finite float is tagged; anything that is not a plain
``dict``/``list``/``tuple``/``str``/``int``/``float``/``bool``/``None``, such as a ``torch.Size``
or an enum) is stored as a DCP non-tensor value: what the project does for every non-tensor value
(``torch.save`` bytes, read back only through ``torch.load(weights_only=True)`` unless the caller
trusts the checkpoint). Subclasses of ``dict`` (``OrderedDict``) come back as plain ``dict`` with
their order kept; attributes set on them (a module state dict's ``_metadata``) are not kept.

Skeleton nodes: a JSON scalar is itself; every other node is a one-key object whose key is its
tag: ``d`` (a dict with string keys: an object), ``m`` (a dict with other keys: ``[key, value]``
pairs), ``l`` (list), ``t`` (tuple), ``f`` (``"nan"``, ``"inf"``, ``"-inf"``), ``T`` (a tensor's
key), ``o`` (a non-tensor value's key). So a user's dict can never be mistaken for a tag.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..dcp.reader import CheckpointReader
from ..dcp.writer import CheckpointWriter
from ..errors import CheckpointError, CorruptCheckpointError, as_checkpoint_error
from ..format.dcp_metadata import torch_dtype
from ..format.manifest import ObjectEntry, TensorEntry

__all__ = ["MAX_DEPTH", "TREE_KEY", "decode_tree", "encode_tree", "load_tree", "save_tree"]

#: The manifest metadata key that holds the skeleton (with its own version, so that a reader
#: refuses a skeleton layout it does not know, by name).
TREE_KEY = "goodput_ckpt.tree"
TREE_VERSION = 1
#: Nesting bound on save and on load: a cycle or a hostile skeleton ends in a typed error, not a
#: RecursionError. Trainer dicts nest about 6 deep (optimizer state: 5).
MAX_DEPTH = 64

_SCALARS = (str, int, bool, type(None))
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _key_part(p: Any) -> str:
    return str(p).replace("/", "%2F")


def encode_tree(tree: Any) -> tuple[Any, dict[str, Any]]:
    """Split ``tree`` into (skeleton, flat): the JSON skeleton, and the DCP state dict of its
    tensors and non-JSON values, keyed by path.

    Raises:
        CheckpointError: ``tree`` nests deeper than :data:`MAX_DEPTH` (or holds a cycle).
    """
    flat: dict[str, Any] = {}

    def key_for(path: tuple[Any, ...]) -> str:
        base = "/".join(_key_part(p) for p in path) or "value"
        key, n = base, 1
        while key in flat:  # two paths that print alike ("a/b" under keys "a/b" and ("a","b"))
            key, n = f"{base}~{n}", n + 1
        return key

    def enc(x: Any, path: tuple[Any, ...]) -> Any:
        if len(path) > MAX_DEPTH:
            raise CheckpointError(
                f"the checkpoint dict nests deeper than {MAX_DEPTH} levels at {'/'.join(map(str, path[:8]))}/..."
            )
        t = type(x)
        if t in _SCALARS:
            return x
        if t is float:
            return x if math.isfinite(x) else {"f": repr(x)}
        if isinstance(x, torch.Tensor):
            key = key_for(path)
            flat[key] = x
            return {"T": key}
        if isinstance(x, dict):
            if all(type(k) is str for k in x):
                return {"d": {k: enc(v, (*path, k)) for k, v in x.items()}}
            return {"m": [[enc(k, (*path, "key")), enc(v, (*path, k))] for k, v in x.items()]}
        if t is list:
            return {"l": [enc(v, (*path, i)) for i, v in enumerate(x)]}
        if t is tuple:
            return {"t": [enc(v, (*path, i)) for i, v in enumerate(x)]}
        key = key_for(path)
        flat[key] = x  # torch.save bytes in the checkpoint; weights_only on load
        return {"o": key}

    return enc(tree, ()), flat


def decode_tree(skeleton: Any, values: Mapping[str, Any], *, where: str = "") -> Any:
    """Rebuild the tree from its skeleton and the loaded ``values`` (key -> tensor or value).

    Raises:
        CorruptCheckpointError: the skeleton is not one :func:`encode_tree` writes, or names a
            value that is not in ``values``.
    """

    def bad(msg: str, path: list[Any]) -> CorruptCheckpointError:
        at = "/".join(map(str, path)) or "(root)"
        return CorruptCheckpointError(f"{where}: the checkpoint skeleton at {at!r:.200} {msg}", path=where or None)

    def dec(node: Any, path: list[Any]) -> Any:
        if len(path) > MAX_DEPTH:
            raise bad(f"nests deeper than {MAX_DEPTH} levels", path[:8])
        if type(node) in _SCALARS or type(node) is float:
            return node
        if type(node) is not dict or len(node) != 1:
            raise bad(f"holds {type(node).__name__} {node!r:.80}, not a scalar or a one-key tagged object", path)
        ((tag, body),) = node.items()
        if tag == "d" and type(body) is dict:
            return {k: dec(v, [*path, k]) for k, v in body.items()}
        if tag == "m" and type(body) is list:
            out = {}
            for pair in body:
                if type(pair) is not list or len(pair) != 2:
                    raise bad("holds a mapping entry that is not a [key, value] pair", path)
                k = dec(pair[0], [*path, "key"])
                try:
                    out[k] = dec(pair[1], [*path, k])
                except TypeError as e:  # an unhashable key
                    raise bad(f"holds an unusable mapping key ({e})", path) from None
            return out
        if tag in ("l", "t") and type(body) is list:
            items = [dec(v, [*path, i]) for i, v in enumerate(body)]
            return items if tag == "l" else tuple(items)
        if tag == "f" and body in _NON_FINITE:
            return _NON_FINITE[body]
        if tag in ("T", "o") and type(body) is str:
            if body not in values:
                raise bad(f"names {body!r:.200}, which the checkpoint does not hold", path)
            return values[body]
        raise bad(f"holds an unknown node {tag!r:.40}", path)

    return dec(skeleton, [])


def save_tree(tree: Any, uri: str | os.PathLike, *, process_group: Any = None, **writer_options: Any) -> None:
    """Save ``tree`` at ``uri`` (replacing a checkpoint there): one process writes it
    (``no_dist``) unless ``process_group`` is given, whose ranks then all call this together.

    Raises:
        CheckpointError: the save failed (the original error is its cause).
    """
    skeleton, flat = encode_tree(tree)
    metadata = {TREE_KEY: {"version": TREE_VERSION, "root": skeleton}}
    writer = CheckpointWriter(uri, overwrite=True, metadata=metadata, **writer_options)
    try:
        dcp.save(flat, storage_writer=writer, process_group=process_group, no_dist=process_group is None)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise as_checkpoint_error(e, f"saving the checkpoint at {writer.checkpoint_id}")  # noqa: B904 - it chains e


def load_tree(uri: str | os.PathLike, *, process_group: Any = None, **reader_options: Any) -> Any:
    """Load what :func:`save_tree` saved at ``uri``; tensors land on the CPU.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``uri``.
        CorruptCheckpointError: a file or the skeleton is damaged (names the file).
        CheckpointError: the location holds a checkpoint of ours that was not saved from a
            trainer's dict (no skeleton), or another failure.
    """
    reader = CheckpointReader(uri, process_group=process_group, **reader_options)
    where = str(reader.checkpoint_id)
    manifest = reader.manifest
    meta = manifest.metadata.get(TREE_KEY)
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"{where} is a goodput-ckpt checkpoint, but not one saved from a trainer's checkpoint dict "
            f"(its manifest has no {TREE_KEY!r} metadata): load it with dcp.load and CheckpointReader",
            path=where,
        )
    if meta.get("version") != TREE_VERSION:
        raise CheckpointError(
            f"{where}: checkpoint skeleton version {meta.get('version')!r:.40} is not supported "
            f"(this library reads version {TREE_VERSION})",
            path=where,
            version=str(meta.get("version"))[:40],
        )
    state: dict[str, Any] = {}
    for key, entry in manifest.items.items():
        if isinstance(entry, TensorEntry):
            state[key] = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype, key))
        elif isinstance(entry, ObjectEntry):
            state[key] = None  # replaced by the decoded value
    try:
        dcp.load(state, storage_reader=reader, process_group=process_group, no_dist=process_group is None)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise as_checkpoint_error(e, f"loading the checkpoint at {where}")  # noqa: B904 - it chains e
    return decode_tree(meta.get("root"), state, where=where)


def check_tree_kind(tree: Any, uri: str, *, kind: str, version: int, layout: str) -> dict[str, Any]:
    """``tree`` (a :func:`load_tree` result) when it is a checkpoint of ``kind`` in layout
    ``version``: the one check every trainer adapter makes before reading its fields, so that a
    checkpoint of another adapter, or of a newer layout, is refused by name rather than read as
    if it were this one. ``layout`` names the adapter's layout in the message ("Trainer").

    Raises:
        CheckpointError: another kind, or another layout version (values quoted, truncated).
    """
    if not isinstance(tree, dict) or tree.get("kind") != kind:
        found = tree.get("kind") if isinstance(tree, dict) else type(tree).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        raise CheckpointError(f"{uri} is a goodput-ckpt checkpoint of {found!r:.60}, not of {article} {kind}", path=uri)
    if tree.get("version") != version:
        raise CheckpointError(
            f"{uri}: {layout} checkpoint layout version {tree.get('version')!r:.40} is not supported "
            f"(this library reads version {version})",
            path=uri,
            version=str(tree.get("version"))[:40],
        )
    return tree
