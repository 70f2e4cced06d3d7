"""``convert``: between the goodput format (``goodput``), torch DCP (``dcp``), ``torch.save`` (``torch``)
and safetensors (``safetensors``), streaming with bounded memory.

Input detection (:func:`detect_format`): a directory (or prefix) with ``manifest.json`` is
``goodput``; with ``.metadata``, ``dcp``; with ``*.safetensors`` files (and optionally
``model.safetensors.index.json``), ``safetensors``. A single file is ``safetensors`` when it
starts with a safetensors header and ``torch`` when it is a zip archive or a legacy pickle.
Data files without their commit record (``rank*.bin`` without ``manifest.json``, ``*.distcp``
without ``.metadata``) are refused as incomplete.

Every format is read and written tensor range by tensor range (see
:mod:`._formats.base`), so memory stays at a few chunks (``dcp`` input: about one saved
shard). Tensors keep their exact bytes, dtypes and shapes in every direction. Non-tensor values
are copied as ``torch.save`` bytes into ``goodput`` (never unpickled; its reader decodes them
with ``weights_only=True``), decoded (``weights_only=True`` unless ``trust_pickle``) and saved
again when written to ``dcp`` or ``torch`` (whose stock loaders unpickle without restriction,
so a value our reader refuses never passes through), and written to a JSON
sidecar for ``safetensors``, which holds only tensors. ``goodput`` output is one rank's file
with whole tensors (``reshard`` splits it for M ranks); ``dcp`` output is one ``.distcp`` file.

``torch`` input and output must be local paths (the format is read through an mmap); the other
formats work on any store.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from ...dcp.writer import DEFAULT_CHUNK_SIZE, DEFAULT_WRITE_THREADS
from ...errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError
from ...format.commit_record import no_record_message
from ...format.manifest import MANIFEST_NAME
from ...storage import Store
from .._common import NO_PROGRESS, Progress, open_location, require_positive, same_location, sniff_file
from .._formats.base import Source, TensorMeta
from .._formats.dcp_fs import METADATA_NAME, DcpSource, write_dcp
from .._formats.goodput import GoodputSource
from .._formats.goodput_write import write_goodput
from .._formats.input_checks import check_planner_data
from .._formats.safetensors_file import open_safetensors, split_file_uri
from .._formats.safetensors_write import write_safetensors
from .._formats.select import SelectedSource
from .._formats.torch_file import TorchSource, write_torch

__all__ = ["FORMATS", "ConvertReport", "convert_checkpoint", "detect_format", "open_source"]

FORMATS = ("goodput", "dcp", "torch", "safetensors")
#: ``select`` values of :func:`convert_checkpoint`.
SELECTIONS = ("auto", "model", "all")
#: The section a ``CheckpointManager`` checkpoint keeps its model under (state.bundle).
MODEL_PREFIX = "model."


@dataclass
class ConvertReport:
    src: str
    dst: str
    src_format: str
    dst_format: str
    tensors: int = 0
    objects: int = 0
    tensor_bytes: int = 0
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)
    #: What was exported: ``all``, ``model`` (a manager checkpoint's model, prefix stripped)
    #: or ``keys``; and the aliases of tied weights left out (written once).
    selection: str = "all"
    tied_dropped: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        """Tensor bytes per second, in GB/s (1e9 bytes)."""
        return self.tensor_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _local_file(uri: str) -> str | None:
    text = os.fspath(uri)
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        return None
    return text


def detect_format(uri: str, **options: Any) -> str:
    """The format of the checkpoint at ``uri`` (one of :data:`FORMATS`).

    Raises:
        CheckpointNotFoundError: nothing is there.
        IncompleteCheckpointError: data files without their commit record.
        CheckpointError: the format cannot be told.
    """
    local = _local_file(uri)
    if local is not None and os.path.isfile(local):
        fmt = sniff_file(local)
        if fmt is None:
            raise CheckpointError(
                f"{uri} is neither a safetensors nor a torch.save file; pass the input format explicitly", path=str(uri)
            )
        return fmt
    if str(uri).endswith(".safetensors") and (local is None):
        return "safetensors"
    store = open_location(uri, options)
    names = store.list()
    if not names:
        raise CheckpointNotFoundError(f"no checkpoint at {store.uri}", path=store.uri)
    top = [n for n in names if "/" not in n]
    if MANIFEST_NAME in top:
        return "goodput"
    if METADATA_NAME in top:
        return "dcp"
    if any(n.endswith(".safetensors") for n in top):
        return "safetensors"
    if any(n.endswith(".bin") and n.startswith("rank") for n in top):
        raise IncompleteCheckpointError(no_record_message(store.uri, len(names)), path=store.uri)
    if any(n.endswith(".distcp") for n in top):
        raise IncompleteCheckpointError(
            f"{store.uri} holds .distcp files but no {METADATA_NAME}: the DCP save never finished", path=store.uri
        )
    raise CheckpointError(f"cannot tell the format of {store.uri}; pass the input format explicitly", path=store.uri)


def open_source(
    uri: str, fmt: str, *, trust_pickle: bool = False, verify: bool = True, options: dict[str, Any] | None = None
) -> Source:
    """Open ``uri`` as a converter :class:`~._formats.base.Source` of format ``fmt``."""
    if fmt == "goodput":
        return GoodputSource(open_location(uri, options), verify=verify, trust_pickle=trust_pickle)
    if fmt == "dcp":
        return DcpSource(open_location(uri, options), trust_pickle=trust_pickle)
    if fmt == "torch":
        path = _local_file(uri)
        if path is None:
            raise ValueError(f"the torch format is read from a local file; {uri} is not one")
        return TorchSource(path, trust_pickle=trust_pickle)
    if fmt == "safetensors":
        local = _local_file(uri)
        if (local is not None and os.path.isfile(local)) or str(uri).endswith(".safetensors"):
            parent, name = split_file_uri(uri)
            return open_safetensors(open_location(parent, options), name)
        return open_safetensors(open_location(uri, options), None)
    raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")


def convert_checkpoint(
    src: str,
    dst: str,
    *,
    to: str,
    source_format: str | None = None,
    trust_pickle: bool = False,
    overwrite: bool = False,
    shard_size: int | None = None,
    chunk_size: int | None = None,
    thread_count: int | None = None,
    verify: bool = True,
    progress: Progress = NO_PROGRESS,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
    select: str = "auto",
    keys: list[str] | None = None,
    strip_prefix: str | None = None,
) -> ConvertReport:
    """Convert the checkpoint at ``src`` into format ``to`` at ``dst`` (module docstring).

    Args:
        to: ``goodput``, ``dcp``, ``torch`` or ``safetensors``.
        source_format: the input format; detected when ``None``.
        trust_pickle: unpickle without restrictions (only for inputs you trust).
        overwrite: replace what is at ``dst``.
        shard_size: safetensors directory output: bytes per shard (HF-style shards + index).
        chunk_size: goodput output: hash chunk size (default 8 MiB).
        thread_count: parallel range reads and writes (default 4).
        verify: goodput input: check every chunk's blake3 while reading.
        select: ``auto`` (the default): a ``CheckpointManager`` checkpoint converted to
            safetensors exports its model alone, ``model.`` stripped, tied weights once (a
            Hugging Face model directory); anything else exports everything. ``model``
            forces the model export, ``all`` exports every key as stored.
        keys: export only keys matching one of these ``fnmatch`` patterns (with
            ``strip_prefix``, removed from their names); tied weights are written once.

    Raises:
        ValueError: bad arguments or ``dst`` equal to ``src``.
        CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError: the input
            is missing, uncommitted or damaged.
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is false.
        CheckpointError: a value the output format cannot hold (named), or an input that
            needs ``trust_pickle``.
    """
    if to not in FORMATS:
        raise ValueError(f"unknown output format {to!r}; known: {', '.join(FORMATS)}")
    if source_format is not None and source_format not in FORMATS:
        raise ValueError(f"unknown input format {source_format!r}; known: {', '.join(FORMATS)}")
    require_positive("thread_count", thread_count)
    require_positive("chunk_size", chunk_size)
    require_positive("shard_size", shard_size)
    if shard_size is not None and to != "safetensors":
        raise ValueError("shard_size applies to safetensors output only")
    if shard_size is not None and str(dst).endswith(".safetensors"):
        raise ValueError(f"shard_size needs a directory destination; {dst} names a single .safetensors file")
    if select not in SELECTIONS:
        raise ValueError(f"unknown select {select!r}; known: {', '.join(SELECTIONS)}")
    if (keys or strip_prefix) and select != "auto":
        raise ValueError(
            f"keys/strip_prefix choose the keys themselves; they cannot be combined with select={select!r}"
        )
    if strip_prefix and not keys:
        keys = [strip_prefix + "*"]
    if same_location(str(src), str(dst)):
        raise ValueError(
            f"the destination {dst} must differ from the source {src}: it is the source, an alias of it, inside it or around it; "
            "convert into a separate location"
        )
    threads = thread_count or DEFAULT_WRITE_THREADS
    t0 = time.perf_counter()
    fmt = source_format or detect_format(src, **(src_options or {}))
    with open_source(src, fmt, trust_pickle=trust_pickle, verify=verify, options=src_options) as opened:
        check_planner_data(opened)
        source, selection, dropped = _select(opened, to, select, keys, strip_prefix)
        report = ConvertReport(source.uri, str(dst), fmt, to, selection=selection, tied_dropped=dropped)
        tensors = source.tensors()
        report.tensors, report.objects = len(tensors), len(source.items) - len(tensors)
        report.tensor_bytes = sum(t.nbytes for t in tensors)
        if to == "goodput":
            store = open_location(dst, dst_options)
            _refuse_same(source, store)
            metadata = dict(source.metadata)
            metadata["goodput_convert"] = {"from_format": fmt, "from_world_size": source.world_size}
            assign = {k: (None if isinstance(m, TensorMeta) else 0) for k, m in source.items.items()}
            summary = write_goodput(
                source,
                store,
                assign,
                world_size=1,
                chunk_size=chunk_size or DEFAULT_CHUNK_SIZE,
                thread_count=threads,
                overwrite=overwrite,
                metadata=metadata,
                progress=progress,
            )
            report.dst, report.files = store.uri, summary.files + [MANIFEST_NAME]
        elif to == "dcp":
            store = open_location(dst, dst_options)
            _refuse_same(source, store)
            report.dst = store.uri
            report.files = write_dcp(source, store, overwrite=overwrite, thread_count=threads, progress=progress)
        elif to == "torch":
            path = _local_file(dst)
            if path is None:
                raise ValueError(f"the torch format is written to a local file; {dst} is not one")
            report.dst = os.path.abspath(path)
            report.files = write_torch(source, path, overwrite=overwrite, thread_count=threads, progress=progress)
        else:
            if str(dst).endswith(".safetensors"):
                parent, name = split_file_uri(dst)
                store, single = open_location(parent, dst_options), name
            else:
                store, single = open_location(dst, dst_options), None
            report.dst = str(dst) if single else store.uri
            report.files = write_safetensors(
                source,
                store,
                single,
                shard_bytes=shard_size,
                overwrite=overwrite,
                thread_count=threads,
                progress=progress,
            )
    report.seconds = time.perf_counter() - t0
    return report


def _select(
    source: Source, to: str, select: str, keys: list[str] | None, strip: str | None
) -> tuple[Source, str, list[str]]:
    """The part of ``source`` to export, its description, and the tied aliases left out.

    Why the default differs by output: safetensors is what Hugging Face loads, and
    ``from_pretrained`` wants the model's own names and nothing else (optimizer, RNG and
    loader tensors would be unexpected keys, ``model.``-prefixed ones missing keys). The
    other formats are checkpoints and keep everything unless asked.
    """
    training = source.metadata.get("training_state")
    tied = training.get("tied") if isinstance(training, dict) else None
    tied = (
        {k: v for k, v in tied.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(tied, dict) else {}
    )
    if keys:
        patterns, prefix, selection = list(keys), strip, "keys"
    elif select == "model" or (select == "auto" and to == "safetensors" and isinstance(training, dict)):
        patterns, prefix, selection = [MODEL_PREFIX + "*"], MODEL_PREFIX, "model"
    else:
        return source, "all", []
    # An alias goes only when the tensor it is tied to is exported too.
    chosen = {k for k in source.items if any(fnmatchcase(k, p) for p in patterns)}
    dropped = sorted(a for a, kept in tied.items() if a in chosen and kept in chosen)
    return SelectedSource(source, patterns, prefix, dropped), selection, dropped


def _refuse_same(source: Source, store: Store) -> None:
    if store.traits.local_path is not None and os.path.isfile(store.traits.local_path):
        raise ValueError(f"{store.uri} is a file; goodput and dcp outputs are directories")
    if same_location(source.uri, store):
        raise ValueError(
            f"the destination {store.uri} must differ from the source {source.uri}: it is the source, "
            "an alias of it, inside it or around it; convert into a separate location"
        )
