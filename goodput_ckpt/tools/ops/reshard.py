"""``reshard``: rewrite a checkpoint for a different number of ranks.

Every tensor is split along dim 0 the way FSDP2's ``Shard(0)`` (``torch.chunk``) splits it:
``ceil(n / M)`` rows per rank, the last ranks possibly fewer or none. Rank ``r``'s pieces of
every tensor go into rank ``r``'s file, so each rank of a job restarted at ``M`` ranks reads one
contiguous byte range per tensor. ``M = 1`` consolidates: one file, whole tensors. The output is
an ordinary goodput-format checkpoint: ``dcp.load`` with ``CheckpointReader`` loads it at any world
size, fastest at ``M`` ranks with ``Shard(0)``.

Streaming: tensors are read from the source and written chunk by chunk (hash chunks of
``chunk_size`` bytes, ``thread_count`` in flight), every source byte verified against its
digest, every output byte hashed as it is written. Memory stays at a few chunks, whatever the
tensor sizes.

What is *not* split: 0-dim and empty tensors (kept whole on rank 0), and everything in the
``rng`` and ``dataloader`` sections (kept whole). Non-tensor values are copied byte for byte
(never unpickled).

**Per-rank state policy.** RNG and dataloader entries that belong to one rank are recognized by
a key component ``rank<N>`` or ``rank_<N>`` (``rng.rank3.cpu``, ``dataloader.rank_00003``)
inside the ``rng``/``dataloader`` sections; ``CheckpointManager``'s ``rng.rows`` and
``dataloader.rows`` (every rank's generators and dataloader state as the rows of one tensor each,
training-state schema 2) are per-rank state too, of all ranks at once. They cannot be split or merged meaningfully, so:

- ``keep``: copy each under its original key (rank ``r``'s entry into rank ``r``'s file, or rank
  0's when ``r >= M``; the ``rows`` tensors whole into rank 0's). The default when ``M`` equals the
  source's world size.
- ``drop``: leave them out; a job resumed at ``M`` ranks re-seeds its RNGs and restarts its
  dataloaders' epoch position.
- ``auto`` (default): ``keep`` when the world size is unchanged, or when the dataloader entries
  hold ``ElasticSampler`` positions (a restore at ``M`` ranks splits the data position among them
  and re-derives the RNG, see docs/manager.md); when it changes and other per-rank entries exist,
  refuse with a ``ValueError`` that asks for ``keep`` or ``drop``, so that no
  mismatch is silent.

The policy applied and the source world size are recorded in the output manifest's metadata
under ``goodput_reshard``. Elastic data positions (a ``CheckpointManager`` checkpoint whose
dataloader record says ``elastic``) are global, not per rank: ``drop`` carries them over (it
drops the RNG only) and records the old rank count as the dataloader's ``ranks``.
For checkpoints written by ``CheckpointManager``, ``drop`` also
updates its training-state record (no RNG/dataloader state, the new world size), and ``keep``
leaves the old world size there, so that a restore at a different size refuses the per-rank
state by name (``TopologyChangeError``) rather than apply another rank's RNG.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from ...dcp.writer import DEFAULT_CHUNK_SIZE, DEFAULT_WRITE_THREADS
from ...state.per_rank import DATALOADER, RNG, ROWS
from .._common import NO_PROGRESS, Progress, open_location, refuse_plain_file, require_positive, same_location
from .._formats.base import TensorMeta
from .._formats.goodput import GoodputSource
from .._formats.goodput_write import write_goodput
from .inspect import TRAINING_STATE_KEY, section_of

__all__ = ["RANK_STATE_POLICIES", "ReshardReport", "per_rank_keys", "reshard_checkpoint"]

RANK_STATE_POLICIES = ("auto", "keep", "drop")
_RANK_PART = re.compile(r"rank_?(\d+)\Z")
_WHOLE_SECTIONS = ("rng", "dataloader")
#: Every rank's RNG or dataloader state, one row per rank (``state.bundle``): kept or dropped whole.
_ROWS_KEYS = (f"{RNG}.{ROWS}", f"{DATALOADER}.{ROWS}")


def per_rank_keys(keys) -> dict[str, int]:
    """The keys that hold one rank's RNG or dataloader state, with that rank (``rng.rows`` and
    ``dataloader.rows``, all ranks' rows in one tensor, with rank 0: the rank whose file keeps it)."""
    out: dict[str, int] = {}
    for key in keys:
        if key in _ROWS_KEYS:
            out[key] = 0
            continue
        if section_of(key) not in _WHOLE_SECTIONS:
            continue
        for part in key.split("."):
            m = _RANK_PART.match(part)
            if m:
                out[key] = int(m.group(1))
                break
    return out


@dataclass
class ReshardReport:
    src: str
    dst: str
    src_world_size: int
    world_size: int
    rank_state: str
    tensors: int = 0
    objects: int = 0
    tensor_bytes: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)
    per_rank_kept: list[str] = field(default_factory=list)
    per_rank_dropped: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        """Tensor bytes per second, in GB/s (1e9 bytes)."""
        return self.tensor_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def reshard_checkpoint(
    src: str,
    dst: str,
    *,
    world_size: int,
    rank_state: str = "auto",
    overwrite: bool = False,
    thread_count: int | None = None,
    chunk_size: int | None = None,
    verify: bool = True,
    progress: Progress = NO_PROGRESS,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
) -> ReshardReport:
    """Rewrite the checkpoint ``src`` at ``dst`` for ``world_size`` ranks (module docstring).

    Args:
        rank_state: per-rank RNG/dataloader policy: ``auto``, ``keep`` or ``drop``.
        overwrite: replace a committed checkpoint at ``dst``.
        thread_count: parallel chunk writers (default 4).
        chunk_size: hash chunk size of the output (default 8 MiB).
        verify: check every source chunk's blake3 while reading (default on).
        progress: receives the bytes written.

    Raises:
        ValueError: bad arguments, ``dst`` equals ``src``, or ``auto`` met per-rank entries
            while the world size changes.
        CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError: the source
            is missing, uncommitted or damaged (nothing is committed at ``dst``).
        CheckpointExistsError: ``dst`` holds a checkpoint and ``overwrite`` is false.
    """
    require_positive("world_size", world_size)
    require_positive("thread_count", thread_count)
    require_positive("chunk_size", chunk_size)
    if rank_state not in RANK_STATE_POLICIES:
        raise ValueError(f"rank_state must be one of {', '.join(RANK_STATE_POLICIES)}, got {rank_state!r}")
    t0 = time.perf_counter()
    src_store = open_location(src, src_options)
    refuse_plain_file(src_store)
    dst_store = open_location(dst, dst_options)
    if same_location(src_store, dst_store):
        raise ValueError(
            f"the destination {dst_store.uri} must differ from the source {src_store.uri}: it is the source, "
            "an alias of it, inside it or around it; reshard into a separate location"
        )
    threads = thread_count or DEFAULT_WRITE_THREADS
    with GoodputSource(src_store, verify=verify, cache_chunks=threads + 2) as source:
        m0 = source.world_size or 1
        per_rank = per_rank_keys(source.items)
        elastic = _elastic_data(source.metadata)
        policy = rank_state
        if policy == "auto":
            if per_rank and world_size != m0 and not elastic:
                raise ValueError(
                    f"{src_store.uri} holds per-rank RNG/dataloader state "
                    f"(e.g. {next(iter(per_rank))!r}) and was saved by {m0} rank(s); resharding to "
                    f"{world_size} cannot map them one to one. Choose: rank_state='drop' "
                    "(--rank-state drop: resumed ranks re-seed and restart their dataloaders) or "
                    "'keep' (--rank-state keep: copy them under their old keys)."
                )
            policy = "keep"
        assign: dict[str, int | None] = {}
        report = ReshardReport(src_store.uri, dst_store.uri, m0, world_size, policy)
        for key, meta in source.items.items():
            if key in per_rank:
                if policy == "drop" and not (elastic and section_of(key) == "dataloader"):
                    report.per_rank_dropped.append(key)
                    continue
                report.per_rank_kept.append(key)
                assign[key] = per_rank[key] if per_rank[key] < world_size else 0
            elif isinstance(meta, TensorMeta) and section_of(key) not in _WHOLE_SECTIONS:
                assign[key] = None  # split along dim 0
            else:
                assign[key] = 0
        metadata = _updated_training_state(dict(source.metadata), policy, world_size, elastic=elastic)
        metadata["goodput_reshard"] = {
            "from_world_size": m0,
            "world_size": world_size,
            "rank_state": policy,
            "dropped": len(report.per_rank_dropped),
        }
        summary = write_goodput(
            source,
            dst_store,
            assign,
            world_size=world_size,
            chunk_size=chunk_size or DEFAULT_CHUNK_SIZE,
            thread_count=threads,
            overwrite=overwrite,
            metadata=metadata,
            progress=progress,
        )
    report.tensors = summary.tensors
    report.objects = summary.objects
    report.tensor_bytes = summary.manifest.tensor_bytes()
    report.bytes_written = summary.bytes_written
    report.files = summary.files
    report.seconds = time.perf_counter() - t0
    return report


def _elastic_data(metadata: dict[str, Any]) -> bool:
    """Whether a ``CheckpointManager`` checkpoint's dataloader entries are ElasticSampler positions."""
    ts = metadata.get(TRAINING_STATE_KEY)
    dl = ts.get("dataloader") if isinstance(ts, dict) else None
    return isinstance(dl, dict) and dl.get("elastic") is True


def _updated_training_state(
    metadata: dict[str, Any], policy: str, world_size: int, *, elastic: bool = False
) -> dict[str, Any]:
    """Keep ``CheckpointManager``'s training-state record true to what was written.

    With ``drop`` the per-rank sections are gone, so the record says so and takes the new world
    size: a restore at ``world_size`` ranks then loads model, optimizer and the rest, and asks
    for no RNG or dataloader state. With ``keep`` the record keeps the old world size, so that a
    restore at a different size refuses the per-rank state by name (or skips it with
    ``allow_topology_change``) instead of applying another rank's RNG.
    """
    ts = metadata.get(TRAINING_STATE_KEY)
    if policy != "drop" or not isinstance(ts, dict):
        return metadata
    ts = dict(ts)
    dropped = ("rng",) if elastic else _WHOLE_SECTIONS
    if elastic:  # the positions stay: say how many old ranks' entries there are
        ts["dataloader"] = {**ts["dataloader"], "ranks": ts["dataloader"].get("ranks", ts.get("world_size"))}
    ts["world_size"] = world_size
    for section in dropped:
        ts[section] = None
    if isinstance(ts.get("sections"), list):
        ts["sections"] = [s for s in ts["sections"] if s not in dropped]
    metadata[TRAINING_STATE_KEY] = ts
    return metadata
