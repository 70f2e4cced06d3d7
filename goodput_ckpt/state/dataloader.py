"""Per-rank dataloader state: one opaque, safely loadable blob per rank.

A dataloader's ``state_dict()`` changes shape as it runs (torchdata's ``StatefulDataLoader``
adds worker snapshots once its iterator exists), and DCP can only load keys that the
destination already has. So the state is not spread over DCP keys: it is serialized with
``torch.save`` into one ``uint8`` blob, and decoded with ``torch.load(weights_only=True)``.
Training-state schema 2 stores each rank's blob as its row of one tensor (:func:`encode_dataloader_row`:
an 8-byte little-endian length, the blob, zeros up to the widest rank's row; a row of zeros for
a rank whose save had no dataloader); schema 1 stored it under a rank-unique key, one manifest
item per rank. It is checked at save time, so a dataloader whose state could
not be loaded safely fails its first save instead of its restore.

The manifest also records what the state depends on (:func:`describe_dataloader`): the worker
count and the batch size. A dataloader resumed with a different worker count would silently
replay or skip samples, so the restore refuses it (see ``state.bundle``) -- unless the loader's
sampler is elastic (``goodput_ckpt.data.ElasticSampler``): its position is global, so a restore
under another world size, worker count or batch size hands every old rank's blob to the
sampler (:func:`elastic_sampler_of`); the coordinator reads them and shares their bytes with the
other ranks (``state.loader_share``). The sampler is found by its methods, because
``data/`` sits beside ``state/`` and neither imports the other: :class:`ElasticPositionHolder`
is the contract it meets (structural typing, a ``typing.Protocol``), and
:class:`PreparesElasticResume`, :class:`ChecksSavedState`, :class:`AdoptsSavedEpoch` and
:class:`SplitsJobState` the optional parts a save and a restore use when the holder has them.

**State stored once per job.** Part of a holder's state is the same on every rank (the
``ElasticSampler``'s global record). A holder with :class:`SplitsJobState` splits it off at save
time (:func:`split_loader_state`): each rank's row keeps the rest, and the shared part, JSON of a
few hundred bytes at most, goes into the training-state metadata as
``dataloader.job_position`` (:data:`JOB_POSITION`): every rank writes it, the coordinator's is
the one committed, so the checkpoint holds it once, in the commit record of the very step whose
rows it belongs to. A restore joins it back into each row it decodes before anything reads it
(the holder checks that the row was split from that record).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from ..engine.untrusted_load import check_inflation, walk_state
from ..errors import CheckpointError

__all__ = [
    "JOB_POSITION",
    "ROW_HEADER",
    "AdoptsSavedEpoch",
    "ChecksSavedState",
    "ElasticPositionHolder",
    "PreparesElasticResume",
    "SplitsJobState",
    "check_dataloader",
    "decode_dataloader_row",
    "decode_dataloader_state",
    "describe_dataloader",
    "elastic_sampler_of",
    "encode_dataloader_row",
    "encode_dataloader_state",
    "split_loader_state",
]

#: Bytes before the blob in a row: its length, uint64 little-endian.
ROW_HEADER = 8
#: The key, in the training-state metadata's ``dataloader`` object, of the job-level part of the
#: loader's state (:class:`SplitsJobState`).
JOB_POSITION = "job_position"


@runtime_checkable
class ElasticPositionHolder(Protocol):
    """What holds a loader's global data position (``goodput_ckpt.data.ElasticSampler``,
    ``goodput_ckpt.data.TokenStream``): a restore under another topology hands it every old
    rank's decoded loader state instead of refusing (``state.bundle``)."""

    def elastic_resume(self, loader_states: list[Any], *, batch_size: Any, where: str = "checkpoint") -> str:
        """Take up the position that all old ranks saved together (``loader_states[r]`` is old
        rank ``r``'s); returns a note saying what was resumed."""
        ...


@runtime_checkable
class PreparesElasticResume(Protocol):
    """Optional: checks every old rank's state first and returns the step that applies it, so
    that a bad state is refused before the restore loads anything (else ``elastic_resume``
    checks as it applies)."""

    def prepare_elastic_resume(
        self, loader_states: list[Any], *, batch_size: Any, where: str = "checkpoint"
    ) -> Callable[[], str]: ...


@runtime_checkable
class ChecksSavedState(Protocol):
    """Optional: checks this rank's saved loader state before a same-topology restore applies it."""

    def check_saved_state(self, loader_state: Any, *, batch_size: Any = None, where: str = "checkpoint") -> None: ...


@runtime_checkable
class AdoptsSavedEpoch(Protocol):
    """Optional: after a same-topology restore, takes up the saved epoch at once (the loader
    applies the rest of its state lazily, when its next iterator starts)."""

    def adopt_saved_epoch(self, loader_state: Any) -> None: ...


@runtime_checkable
class SplitsJobState(Protocol):
    """Optional: stores the part of its state that every rank shares once per job (module doc).
    ``split_job_state`` returns ``(row state, JSON record or None)`` without changing the live
    state; ``join_job_state`` joins a decoded row (the caller's to change) and the record read
    back (unchecked: it checks it, and that the row was split from it)."""

    def split_job_state(self, loader_state: Any) -> tuple[Any, Any]: ...

    def join_job_state(self, loader_state: Any, job: Any, *, where: str = "checkpoint") -> Any: ...


def elastic_sampler_of(loader: Any) -> ElasticPositionHolder | None:
    """The loader's elastic position holder, or ``None``: its sampler (``ElasticSampler``, as
    ``loader.sampler`` or ``loader.batch_sampler.sampler``) or its dataset (``TokenStream``), the
    first with a callable ``elastic_resume`` (:class:`ElasticPositionHolder`)."""
    for s in (
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
        getattr(loader, "dataset", None),
    ):
        if callable(getattr(s, "elastic_resume", None)):
            return s  # type: ignore[no-any-return]  # checked structurally above
    return None


def check_dataloader(loader: Any) -> None:
    """Raise ``TypeError`` unless ``loader`` has ``state_dict()`` and ``load_state_dict()``."""
    if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
        raise TypeError(
            f"dataloader must have state_dict() and load_state_dict() (for example torchdata's "
            f"StatefulDataLoader); got {type(loader).__name__}"
        )


def describe_dataloader(loader: Any) -> dict[str, Any]:
    """What the saved position depends on, for the manifest (JSON)."""
    out: dict[str, Any] = {"type": f"{type(loader).__module__}.{type(loader).__qualname__}"}
    for name in ("num_workers", "batch_size"):
        value = getattr(loader, name, None)
        out[name] = value if isinstance(value, int) and not isinstance(value, bool) else None
    out["elastic"] = elastic_sampler_of(loader) is not None
    return out


def split_loader_state(loader: Any) -> tuple[Any, Any]:
    """``(what this rank's row stores, the job-level record or None)`` of ``loader.state_dict()``:
    split by the loader's position holder when it can (:class:`SplitsJobState`), else the whole
    state and ``None``."""
    state = loader.state_dict()
    holder = elastic_sampler_of(loader)
    if isinstance(holder, SplitsJobState):
        return holder.split_job_state(state)
    return state, None


def encode_dataloader_state(loader: Any, *, key: str, state: Any = None) -> torch.Tensor:
    """Serialize ``state`` (default: ``loader.state_dict()``) into a ``uint8`` tensor that loads
    with weights_only.

    Raises:
        CheckpointError: the state holds objects that ``torch.load(weights_only=True)`` refuses.
    """
    if state is None:
        state = loader.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    raw = buf.getvalue()
    try:
        torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:  # noqa: BLE001 - the unpickler raises many types
        raise CheckpointError(
            f"the dataloader state ({type(loader).__name__}.state_dict()) cannot be loaded with "
            f"torch.load(weights_only=True): {type(e).__name__}: {str(e)[:300]}. Keep its "
            "dataset/sampler state to tensors and plain Python types, or register the classes "
            "with torch.serialization.add_safe_globals.",
            key=key,
        ) from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode_dataloader_state(blob: torch.Tensor, *, key: str) -> Any:
    """The state dict stored by :func:`encode_dataloader_state` (weights_only), bounded like any
    value nobody vouches for (``engine.untrusted_load``): its archive may not inflate past its size
    (a deflate bomb), and the decoded state is walked once to refuse a cycle or absurd nesting,
    before anything walks it without a bound (a loader's own ``load_state_dict``).

    Raises:
        CorruptCheckpointError: an inflating archive, or a cyclic or too deeply nested state.
        CheckpointError: the blob does not load with ``weights_only=True``.
    """
    raw = blob.contiguous().numpy().tobytes()
    what = f"the saved dataloader state {key!r}"
    check_inflation(raw, what, key=key)
    try:
        state = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            f"{what} cannot be loaded with weights_only=True ({type(e).__name__}: {str(e)[:300]})",
            key=key,
        ) from None
    for _ in walk_state(state, what, key=key):
        pass
    return state


def encode_dataloader_row(loader: Any, *, key: str, state: Any = None) -> torch.Tensor:
    """:func:`encode_dataloader_state` as a ``uint8[1, 8 + n]`` row: the blob's length, then the
    blob. The save may pad it with zeros to the widest rank's row (``dcp.rank_rows``)."""
    blob = encode_dataloader_state(loader, key=key, state=state)
    row = torch.empty((1, ROW_HEADER + blob.numel()), dtype=torch.uint8)
    row[0, :ROW_HEADER] = torch.frombuffer(bytearray(blob.numel().to_bytes(ROW_HEADER, "little")), dtype=torch.uint8)
    row[0, ROW_HEADER:] = blob
    return row


def decode_dataloader_row(row: torch.Tensor, *, key: str) -> Any:
    """The state dict stored in one row by :func:`encode_dataloader_row`, its length bounded by
    the row before it slices anything.

    Raises:
        CheckpointError: the length does not fit the row, or the blob does not load.
    """
    flat = row.reshape(-1)
    if flat.dtype != torch.uint8 or flat.numel() < ROW_HEADER:
        raise CheckpointError(
            f"the saved dataloader row {key!r} is not a uint8 row of at least {ROW_HEADER} bytes", key=key
        )
    n = int.from_bytes(flat[:ROW_HEADER].numpy().tobytes(), "little")
    if n > flat.numel() - ROW_HEADER:
        raise CheckpointError(
            f"the saved dataloader row {key!r} claims {n} bytes but holds {flat.numel() - ROW_HEADER}", key=key
        )
    if n == 0:  # torch.save never writes 0 bytes: a row the save filled for a rank without one
        raise CheckpointError(f"no dataloader state was saved in {key!r}: that rank's save got no dataloader=", key=key)
    return decode_dataloader_state(flat[ROW_HEADER : ROW_HEADER + n], key=key)
