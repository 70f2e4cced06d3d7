"""``inspect``: what a checkpoint holds, from its manifest alone (no data is read, no torch).

A stock torch DCP checkpoint (``.metadata`` + ``.distcp`` files) is described from its
``.metadata`` instead (keys, dtypes, shapes, sizes, world size; :mod:`._dcp_foreign`, which
imports torch to unpickle it under a restricted unpickler), with ``format`` ``torch-dcp``.

Sections group items by the first component of their key, the way the training-state bundle
names them::

    model*                    -> model       (model, model_ema, ...)
    optim*                    -> optimizer   (optim, optimizer, optimizers, ...)
    rng*, random*             -> rng
    dataloader*, data_loader* -> dataloader
    anything else             -> extra

The step comes from the manifest's metadata (``metadata.step``, or the training state that
``CheckpointManager`` records, ``metadata.training_state.step``), else from a ``step_XXXXXXXX``
directory name.
"""

from __future__ import annotations

import fnmatch
import math
import posixpath
from dataclasses import dataclass, field
from typing import Any

from ...format.commit_record import file_problems, read_commit_record
from ...format.manifest import DTYPE_SIZES, FORMAT_NAME, Manifest, TensorEntry
from ...format.references import with_references
from ...manager.step_layout import parse_step_dir
from .._common import is_dcp_location, open_location, refuse_plain_file

__all__ = ["InspectReport", "ItemRow", "SECTIONS", "SectionRow", "inspect_checkpoint", "section_of"]

#: Where ``CheckpointManager`` records the step (``goodput_ckpt.state.bundle.META_KEY``; not
#: imported from there because this module stays free of torch).
TRAINING_STATE_KEY = "training_state"
SECTIONS = ("model", "optimizer", "rng", "dataloader", "extra")
_PREFIXES = (
    ("model", "model"),
    ("optim", "optimizer"),
    ("rng", "rng"),
    ("random", "rng"),
    ("dataloader", "dataloader"),
    ("data_loader", "dataloader"),
)


def section_of(key: str) -> str:
    """The section (one of :data:`SECTIONS`) of a state-dict key."""
    head = key.split(".", 1)[0].lower()
    for prefix, section in _PREFIXES:
        if head.startswith(prefix):
            return section
    return "extra"


@dataclass
class ItemRow:
    """One item: a tensor (``dtype``, ``shape``, ``shards`` saved chunks) or an object."""

    key: str
    section: str
    kind: str
    dtype: str | None
    shape: list[int] | None
    shards: int
    bytes: int


@dataclass
class SectionRow:
    name: str
    tensors: int = 0
    objects: int = 0
    bytes: int = 0


@dataclass
class InspectReport:
    """The outcome of :func:`inspect_checkpoint`.

    ``items`` holds the rows that match ``pattern`` (all when it is ``None``); the totals and
    sections always cover the whole checkpoint. ``problems`` lists files that are missing or of
    the wrong size (a cheap check; ``verify`` hashes the bytes).
    """

    uri: str
    format: str
    #: The format version (an int); for ``torch-dcp``, DCP's metadata version (a string) or ``None``.
    version: int | str | None
    library_version: str
    torch_version: str
    created_at: str
    step: int | None
    world_size: int
    chunk_size: int
    files: int
    file_bytes: int
    tensor_bytes: int
    object_bytes: int
    tensors: int
    objects: int
    sections: list[SectionRow]
    items: list[ItemRow]
    pattern: list[str] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    #: The training-state schema of a ``CheckpointManager`` checkpoint (``None`` otherwise): a
    #: number of its own, not the format version (docs/format.md, *Versioning*).
    training_schema: int | None = None
    #: Of ``file_bytes``, the bytes of files an earlier step holds (an incremental save's
    #: references, docs/format.md "References"), and the steps (sibling locations) holding them.
    referenced_bytes: int = 0
    bases: list[str] = field(default_factory=list)


def inspect_checkpoint(
    uri: str, *, pattern: str | list[str] | None = None, check_files: bool = True, **options: Any
) -> InspectReport:
    """Describe the checkpoint at ``uri``.

    Args:
        pattern: shell-style glob(s) on keys (``"model.layers.*.weight"``); rows matching any
            are listed.
        check_files: stat every data file and report missing or resized ones in ``problems``.
        **options: backend options for the store.

    Raises:
        CheckpointNotFoundError: nothing is stored at ``uri``.
        IncompleteCheckpointError: files but no manifest (an uncommitted save), or on a mounted
            volume a manifest that does not validate (one still being written or cut short).
        CorruptCheckpointError: the manifest is invalid (where commits are atomic).
        CheckpointError: a manifest version this library does not read.
    """
    store = open_location(uri, options)
    refuse_plain_file(store)
    patterns = [pattern] if isinstance(pattern, str) else (list(pattern) if pattern else None)
    if is_dcp_location(store):
        return _describe_dcp(store, patterns, check_files)
    manifest = read_commit_record(store).manifest_or_raise()
    report = _describe(store.uri, manifest, patterns)
    if check_files:
        report.problems.extend(p.message for p in file_problems(with_references(store, manifest), manifest))
    return report


def _training_schema(metadata: dict[str, Any]) -> int | None:
    ts = metadata.get(TRAINING_STATE_KEY)
    schema = ts.get("schema") if isinstance(ts, dict) else None
    return schema if isinstance(schema, int) and not isinstance(schema, bool) else None


def _metadata_step(metadata: dict[str, Any]) -> int | None:
    ts = metadata.get(TRAINING_STATE_KEY)
    for step in (metadata.get("step"), ts.get("step") if isinstance(ts, dict) else None):
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            return step
    return None


def _describe_dcp(store: Any, patterns: list[str] | None, check_files: bool) -> InspectReport:
    from ._dcp_foreign import DCP_FORMAT, read_dcp

    view = read_dcp(store)
    sections = {name: SectionRow(name) for name in SECTIONS}
    rows: list[ItemRow] = []
    for it in view.items:
        sec = section_of(it.key)
        row = ItemRow(it.key, sec, it.kind, it.dtype, it.shape, it.shards, it.bytes)
        if it.kind == "tensor":
            sections[sec].tensors += 1
        else:
            sections[sec].objects += 1
        sections[sec].bytes += it.bytes
        if patterns is None or any(fnmatch.fnmatchcase(it.key, p) for p in patterns):
            rows.append(row)
    tensors = [i for i in view.items if i.kind == "tensor"]
    return InspectReport(
        uri=view.uri,
        format=DCP_FORMAT,
        version=view.version,
        library_version="",
        torch_version="",
        created_at="",
        step=parse_step_dir(posixpath.basename(view.uri.rstrip("/"))),
        world_size=view.world_size or 0,
        chunk_size=0,
        files=len(view.files),
        file_bytes=view.file_bytes,
        tensor_bytes=sum(i.bytes for i in tensors),
        object_bytes=sum(i.bytes for i in view.items if i.kind == "object"),
        tensors=len(tensors),
        objects=len(view.items) - len(tensors),
        sections=[s for s in sections.values() if s.tensors or s.objects],
        items=rows,
        pattern=patterns,
        problems=[p[2] for p in view.problems] if check_files else [],
    )


def _describe(uri: str, m: Manifest, patterns: list[str] | None) -> InspectReport:
    sections = {name: SectionRow(name) for name in SECTIONS}
    rows: list[ItemRow] = []
    tensor_bytes = object_bytes = tensors = objects = 0
    for key, e in m.items.items():
        sec = section_of(key)
        if isinstance(e, TensorEntry):
            nbytes = math.prod(e.shape) * DTYPE_SIZES[e.dtype]
            row = ItemRow(key, sec, "tensor", e.dtype, list(e.shape), len(e.chunks), nbytes)
            tensors += 1
            tensor_bytes += nbytes
            sections[sec].tensors += 1
        else:  # ObjectEntry: the only other kind parse_manifest admits
            row = ItemRow(key, sec, "object", None, None, 1, e.length)
            objects += 1
            object_bytes += e.length
            sections[sec].objects += 1
        sections[sec].bytes += row.bytes
        if patterns is None or any(fnmatch.fnmatchcase(key, p) for p in patterns):
            rows.append(row)
    step = _metadata_step(m.metadata)
    if step is None:
        step = parse_step_dir(posixpath.basename(uri.rstrip("/")))
    return InspectReport(
        uri=uri,
        format=FORMAT_NAME,
        version=m.version,
        library_version=m.library_version,
        torch_version=m.torch_version,
        created_at=m.created_at,
        step=step,
        world_size=m.world_size,
        chunk_size=m.chunk_size,
        files=len(m.files),
        file_bytes=m.total_bytes(),
        referenced_bytes=m.referenced_bytes(),
        bases=sorted(m.bases()),
        tensor_bytes=tensor_bytes,
        object_bytes=object_bytes,
        tensors=tensors,
        objects=objects,
        sections=[s for s in sections.values() if s.tensors or s.objects],
        items=rows,
        pattern=patterns,
        metadata=dict(m.metadata),
        training_schema=_training_schema(m.metadata),
    )
