"""The JSON sidecar that carries non-tensor values next to safetensors files.

safetensors holds only tensors. A conversion to safetensors writes everything else (step
counters, learning rates, dataloader state, user metadata and the nesting of the state dict)
into ``<stem>.objects.json``, and a conversion from safetensors reads it back, so a round trip
through safetensors loses nothing that JSON can say.

Document::

    {"format": "goodput-ckpt.objects", "version": 1,
     "objects": {"optim.param_groups.0.lr": 0.001, "optim.param_groups.0.betas": {"$tuple": [0.9, 0.95]}},
     "planner_data": {"model.w": ["model", "w"], ...} | null,
     "int_keys": {"optim.state.0.exp_avg": [2], ...},   (optional: docs/format.md, dcp.int_keys)
     "metadata": {...}}

Values are plain JSON where JSON can hold them exactly; other types are tagged objects with a
single ``$``-key: ``$tuple``, ``$dict`` (a dict whose keys are not all strings, or that has a
key starting with ``$``: a list of ``[key, value]`` pairs), ``$float`` (``"nan"``, ``"inf"``,
``"-inf"``), ``$bytes`` (base64), ``$dtype`` (a torch dtype name), ``$size`` (``torch.Size``)
and ``$tensor`` (``{"dtype", "shape", "data": base64 of the raw little-endian bytes}``, for small
tensors nested inside a value). Anything else is refused by name: nothing is pickled.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import torch

from ...errors import CheckpointError, CorruptCheckpointError
from ...format.dcp_metadata import dtype_name, torch_dtype
from ...format.json_document import parse_json_document
from ...format.nesting import int_keys_problem

__all__ = ["SIDECAR_FORMAT", "decode_value", "dump_sidecar", "encode_value", "load_sidecar"]

SIDECAR_FORMAT = "goodput-ckpt.objects"
SIDECAR_VERSION = 1
#: Tensors nested inside a value are inlined as base64; larger ones do not belong in JSON.
MAX_INLINE_TENSOR = 1 << 20
#: The largest sidecar read: it is parsed whole in memory (the manifest's limit).
MAX_SIDECAR_BYTES = 1 << 30


def encode_value(value: Any, key: str) -> Any:
    """``value`` as tagged JSON (see the module docstring).

    Raises:
        CheckpointError: ``value`` holds a type JSON cannot carry.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, torch.Size):
        return {"$size": list(value)}
    if isinstance(value, tuple):
        return {"$tuple": [encode_value(v, key) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, key) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode_value(v, key) for k, v in value.items()}
        return {"$dict": [[encode_value(k, key), encode_value(v, key)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value, key)}
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor and value.layout == torch.strided:
        t = value.detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes > MAX_INLINE_TENSOR:
            raise CheckpointError(
                f"value {key!r} holds a {nbytes}-byte tensor inside a non-tensor value; the JSON "
                f"sidecar inlines at most {MAX_INLINE_TENSOR} bytes. Store it as its own key.",
                key=key,
            )
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            "$tensor": {
                "dtype": dtype_name(t.dtype, key),
                "shape": list(t.shape),
                "data": base64.b64encode(raw).decode("ascii"),
            }
        }
    raise CheckpointError(
        f"value {key!r} of type {type(value).__module__}.{type(value).__qualname__} cannot be "
        "written to the safetensors JSON sidecar (it holds JSON types, tuples, bytes, dtypes and "
        "small tensors); convert to goodput, dcp or torch instead",
        key=key,
    )


def decode_value(doc: Any, key: str) -> Any:
    """The inverse of :func:`encode_value`.

    Raises:
        CorruptCheckpointError: an unknown tag or a malformed tagged value.
    """
    if isinstance(doc, list):
        return [decode_value(v, key) for v in doc]
    if not isinstance(doc, dict):
        return doc
    tags = [k for k in doc if k.startswith("$")]
    if not tags:
        return {k: decode_value(v, key) for k, v in doc.items()}
    if len(doc) != 1:
        raise CorruptCheckpointError(f"sidecar value {key!r}: a tagged object must have exactly one key", key=key)
    tag, body = next(iter(doc.items()))
    try:
        if tag == "$tuple":
            return tuple(decode_value(v, key) for v in body)
        if tag == "$dict":
            return {_hashable(decode_value(k, key)): decode_value(v, key) for k, v in body}
        if tag == "$float":
            return float({"nan": "nan", "inf": "inf", "-inf": "-inf"}[body])
        if tag == "$size":
            return torch.Size(_sizes(body))
        if tag == "$bytes":
            return base64.b64decode(body, validate=True)
        if tag == "$dtype":
            return torch_dtype(body, key)
        if tag == "$tensor":
            dtype = torch_dtype(body["dtype"], key)
            shape = _sizes(body["shape"])
            raw = bytearray(base64.b64decode(body["data"], validate=True))
            if len(raw) != math.prod(shape) * dtype.itemsize:
                raise ValueError("data length does not match dtype and shape")
            if not raw:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"sidecar value {key!r}: malformed {tag} ({e})", key=key) from None
    raise CorruptCheckpointError(f"sidecar value {key!r}: unknown tag {tag!r}", key=key)


def _sizes(v: Any) -> list[int]:
    """A shape: a list of non-negative integers (no floats, booleans or strings, which
    ``int()`` would turn into sizes, and no ``1e400``, which it cannot)."""
    if not isinstance(v, list) or not all(type(x) is int and x >= 0 for x in v):
        raise ValueError(f"a shape must be a list of non-negative integers, got {str(v)[:100]}")
    return v


def _hashable(v: Any) -> Any:
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v


def dump_sidecar(
    objects: dict[str, Any],
    planner_data: dict[str, list[Any]] | None,
    metadata: dict[str, Any],
    int_keys: dict[str, list[int]] | None = None,
) -> bytes:
    doc: dict[str, Any] = {
        "format": SIDECAR_FORMAT,
        "version": SIDECAR_VERSION,
        "objects": {k: encode_value(v, k) for k, v in objects.items()},
        "planner_data": planner_data,
        "metadata": metadata,
    }
    if int_keys:
        doc["int_keys"] = int_keys
    return json.dumps(doc, indent=1, allow_nan=False).encode("utf-8")


def load_sidecar(
    data: bytes, where: str
) -> tuple[dict[str, Any], dict[str, list[Any]] | None, dict[str, Any], dict[str, list[int]]]:
    """``(objects, planner_data, metadata, int_keys)`` from a sidecar document.

    Raises:
        CorruptCheckpointError: not a sidecar of a known version, or malformed.
        CheckpointError: a sidecar version this library does not read.
    """
    doc = parse_json_document(data, where, format_name=SIDECAR_FORMAT, version=SIDECAR_VERSION, what="sidecar")
    objects, pd, md = doc.get("objects", {}), doc.get("planner_data"), doc.get("metadata", {})
    if not isinstance(objects, dict) or not isinstance(md, dict) or not (pd is None or isinstance(pd, dict)):
        raise CorruptCheckpointError(f"{where}: 'objects', 'planner_data' or 'metadata' has the wrong type", path=where)
    if pd is not None and not all(
        isinstance(v, list) and all(isinstance(p, (str, int)) for p in v) for v in pd.values()
    ):
        raise CorruptCheckpointError(f"{where}: 'planner_data' must map keys to lists of path parts", path=where)
    int_keys = doc.get("int_keys")
    why = int_keys_problem(int_keys, pd)
    if why is not None:
        raise CorruptCheckpointError(f"{where}: 'int_keys' {why}", path=where)
    return {k: decode_value(v, k) for k, v in objects.items()}, pd, md, int_keys or {}
