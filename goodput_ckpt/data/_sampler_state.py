"""Reading an ``ElasticSampler``'s saved state back (one validation for both restore paths), and
splitting it into the job-level record and each rank's own part (:mod:`.sampler`).

**Three forms of the saved state.** The iterator's ``state_dict()`` (version 2, what a loader's
``state_dict()`` holds) is self-contained: the sampler's identity, the old world size, the
global record (:class:`~.global_position.GlobalPosition`), the rank and its count. Everything
but the rank and the count is the same on every rank, so a ``CheckpointManager`` save splits it
(:func:`split_job_state`): the *job-level record* ``{MARK: 3, seed, n, shuffle, drop_last,
world_size, position}`` goes once into the commit record (the coordinator's), and each rank's
row keeps ``{MARK: 3, rank, consumed, job}``, ``job`` being the digest of the record it was
split from. A restore joins them back into version 2 (:func:`join_job_state`) before anything
reads them, and refuses a row whose digest is not the record's: a row of ranks that were not
in step with the coordinator, or of another save. Version 1 (a segment history in every row,
:mod:`.position`) and rows holding the whole version-2 state (before the split) are read as
they are.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError, CorruptCheckpointError, TopologyChangeError
from ..format.schema import MAX_WORLD_SIZE
from ._marked import find_marked, replace_marked
from ._saved import saved_int
from .global_position import GlobalPosition, OutOfStepError
from .migrate import from_v1
from .position import EpochPosition

if TYPE_CHECKING:
    from .sampler import ElasticSampler

__all__ = [
    "MARK",
    "READS",
    "ROW_VERSION",
    "VERSION",
    "find_state",
    "join_job_state",
    "saved_consumed",
    "saved_position",
    "share_size",
    "split_job_state",
]

#: Marks the iterator's state dict inside a loader's state, and names its version.
MARK = "goodput_elastic_sampler"
#: The iterator's own, self-contained state.
VERSION = 2
#: A checkpoint row's part and the job-level record it was split from (module docstring).
ROW_VERSION = 3
#: Versions read in a loader state: 1 (a segment history, converted on reading) and 2.
READS = (1, 2)
#: Bound on a saved step count or batch size (they multiply: Python ints, so no overflow).
MAX_STEPS = 1 << 62
#: The keys of a row's part and of the job-level record: nothing else is accepted.
_ROW_KEYS = frozenset({MARK, "rank", "consumed", "job"})
_IDENTITY = ("seed", "n", "shuffle", "drop_last")
#: The key under which ``StatefulDataLoader`` keeps its sampler iterator's state.
_TOP = "_sampler_iter_state"
_JOB_KEYS = frozenset({MARK, *_IDENTITY, "world_size", "position"})


def find_state(loader_state: Any, what: str = "the dataloader state") -> tuple[dict, int] | None:
    """``ElasticSampler.find_state``: the sampler's state in a loader state and the loader's steps
    since that snapshot, or ``None``.

    Raises:
        CheckpointError: more than one sampler state in one loader state.
        CorruptCheckpointError: the walk's bounds (``find_marked``), or bad steps since the snapshot.
    """
    found = find_marked(loader_state, MARK, what)
    if not found:
        return None
    if len(found) > 1:
        raise CheckpointError(f"{what} holds {len(found)} ElasticSampler states; expected one", key="dataloader")
    since = loader_state.get("_steps_since_snapshot", 0) if isinstance(loader_state, dict) else 0
    try:
        return found[0], saved_int(since if since is not None else 0, 0, MAX_STEPS, "_steps_since_snapshot")
    except ValueError as e:
        raise CorruptCheckpointError(f"{what}: {e}", key="dataloader") from None


def share_size(length: int, world_size: int, *, drop_last: bool) -> int:
    """How many of ``length`` pending samples each of ``world_size`` ranks reads (the size of
    ``rank_share``, without building it)."""
    return length // world_size if drop_last else -(-length // world_size)


def _digest(identity: dict[str, Any], world_size: int, pos: GlobalPosition) -> str:
    """16 hex digits naming a job-level record by its values (checked ints and bools only)."""
    values = [identity[k] for k in _IDENTITY] + [world_size, pos.epoch, pos.start, list(pos.taken)]
    return hashlib.blake2b(json.dumps(values).encode(), digest_size=8).hexdigest()


# -- the job-level record --------------------------------------------------------------------
def split_job_state(loader_state: Any) -> tuple[Any, dict | None]:
    """``(row state, job-level record)`` of a live loader's state (module docstring); the state
    itself and ``None`` when it holds no well-formed version-2 sampler state (none, or values a
    restore would refuse: they stay in the row, whole, and are refused there). The loader's own
    state is not changed (the containers on the way to the sampler's state are copied)."""
    try:
        found = find_marked(loader_state, MARK)
    except CheckpointError:  # cyclic or too deep: the row keeps it whole, and a restore refuses it
        return loader_state, None
    if len(found) != 1 or found[0].get(MARK) != VERSION:
        return loader_state, None
    st = found[0]
    try:
        identity = {k: st.get(k) for k in _IDENTITY}
        for k in ("shuffle", "drop_last"):
            if not isinstance(identity[k], bool):
                raise ValueError(k)
        saved_int(identity["seed"], -(1 << 63), (1 << 64) - 1, "seed")
        n = saved_int(identity["n"], 0, MAX_STEPS, "n")
        ws = saved_int(st.get("world_size"), 1, MAX_WORLD_SIZE, "world_size")
        saved_int(st.get("rank"), 0, ws - 1, "rank")
        saved_int(st.get("consumed"), 0, n, "consumed")
        pos = GlobalPosition.from_state(st.get("position"), n)  # a copy in plain types
    except ValueError:
        return loader_state, None
    job = {MARK: ROW_VERSION, **identity, "world_size": ws, "position": pos.to_state()}
    digest = _digest(identity, ws, pos)

    def row(d: dict) -> dict:
        return {MARK: ROW_VERSION, "rank": d["rank"], "consumed": d["consumed"], "job": digest}

    try:
        return replace_marked(loader_state, MARK, row), job
    except ValueError:  # nests too deeply: the row keeps it whole, and a restore refuses it
        return loader_state, None


def _checked_job(s: ElasticSampler, job: Any, what: str) -> tuple[dict, str]:
    """The version-2 fields of the job-level record (all but rank and count) and its digest,
    each value checked (identity against this sampler, world size and position in range)."""
    if not isinstance(job, dict) or job.get(MARK) != ROW_VERSION or set(job) != _JOB_KEYS:
        got = sorted(map(str, job))[:8] if isinstance(job, dict) else type(job).__name__
        raise CorruptCheckpointError(
            f"{what}: the job-level ElasticSampler record must be an object of {sorted(_JOB_KEYS)}, got {got}",
            key="dataloader",
        )
    s._check_identity(job, what)  # exact values, so exact types: JSON gives no others
    try:
        ws = saved_int(job["world_size"], 1, MAX_WORLD_SIZE, "world_size")
        pos = GlobalPosition.from_state(job["position"], len(s.dataset))
    except ValueError as e:
        raise CorruptCheckpointError(f"{what}: the job-level ElasticSampler record: {e}", key="dataloader") from None
    fields = {MARK: VERSION, **s._identity(), "world_size": ws, "position": pos.to_state()}
    return fields, _digest(s._identity(), ws, pos)


def join_job_state(s: ElasticSampler, loader_state: Any, job: Any, *, where: str) -> Any:
    """``loader_state`` (decoded from one row, so owned by the caller: changed in place) with its
    row part joined to the job-level record ``job`` (manifest metadata, unchecked) into the
    version-2 state; as it is when it holds no row part (a version-1 or 2 state, or none).

    Raises:
        CorruptCheckpointError: the row part or the record is malformed, or the record is missing.
        CheckpointError: the record is of another sampler (seed, size, shuffle, drop_last).
        TopologyChangeError: the row was split from another record (its rank was not in step
            with the coordinator's, or the row is another save's).
    """
    top = loader_state.get(_TOP) if isinstance(loader_state, dict) else None
    if isinstance(top, dict) and top.get(MARK) is not None:
        # Where StatefulDataLoader keeps it: no walk (a second sampler state elsewhere is
        # refused by find_state, which every use of the joined state runs).
        rows = [top] if top.get(MARK) == ROW_VERSION else []
    else:
        rows = [d for d in find_marked(loader_state, MARK, where) if d.get(MARK) == ROW_VERSION]
    if not rows:
        return loader_state
    if job is None:
        raise CorruptCheckpointError(
            f"{where}: holds a rank's ElasticSampler count but the commit record holds no job-level "
            "record (training_state.dataloader.job_position) to join it to",
            key="dataloader",
        )
    hit = s._joined  # the rows of one restore share one record: checked once
    if hit is None or hit[0] is not job:
        hit = s._joined = (job, *_checked_job(s, job, where))  # holds ``job``: its id stays its own
    _, fields, digest = hit
    for d in rows:
        if set(d) != _ROW_KEYS:
            raise CorruptCheckpointError(
                f"{where}: a rank's ElasticSampler part must hold {sorted(_ROW_KEYS)}, got {sorted(map(str, d))[:8]}",
                key="dataloader",
            )
        if d["job"] != digest:
            raise TopologyChangeError(
                f"{where}: the row's ElasticSampler position ({d['job']!r:.24}) is not the job's ({digest}): its "
                "rank was not in step with the coordinator's when it saved, or the row is another save's",
                path=where,
                key="dataloader",
            )
        rank, consumed = d["rank"], d["consumed"]  # checked where they are used (saved_position, saved_consumed)
        d.clear()
        d.update(fields, rank=rank, consumed=consumed)  # one position dict shared: parsed once (saved_position)
    return loader_state


# -- one validation for both restore paths ---------------------------------------------------
def saved_position(
    s: ElasticSampler, st: dict, what: str, cache: dict | None = None
) -> tuple[GlobalPosition, int, int]:
    """``(position, world_size, rank)`` of a saved iterator state, after its version and
    identity, each checked (:meth:`.GlobalPosition.from_state`, world size and rank in range).
    A version-1 position is checked and converted (:func:`.migrate.from_v1`, O(n)). ``cache``:
    shared by the old ranks of one restore, which saved the same position: one equal to the last
    one checked (version 1: a segment history of up to 16 x W counts) or the very same object
    (version 2 joined from one record) is not parsed again (equal values: nothing unchecked is used).

    Raises:
        CheckpointError: an unknown version, or another sampler (seed, size, shuffle, drop_last).
        TopologyChangeError: a version-1 position of ranks too far out of step for version 2.
        CorruptCheckpointError: a malformed value, naming ``what`` and the field.
    """
    version = st.get(MARK)
    if version == ROW_VERSION:
        raise CheckpointError(
            f"{what}: a rank's ElasticSampler count without its job-level record; restore it through "
            "CheckpointManager.restore, which joins them",
            key="dataloader",
        )
    if isinstance(version, bool) or version not in READS:
        raise CheckpointError(
            f"{what}: ElasticSampler state version {version!r:.40} is not supported (this "
            f"goodput-ckpt reads {', '.join(map(str, READS))})",
            version=version,
        )
    s._check_identity(st, what)
    n = len(s.dataset)
    cache = {} if cache is None else cache
    try:
        ws = saved_int(st.get("world_size"), 1, MAX_WORLD_SIZE, "world_size")
        rank = saved_int(st.get("rank"), 0, ws - 1, "rank")
        raw = st.get("position")
        if version == VERSION:
            hit = cache.get("v2")
            if hit is None or hit[0] is not raw:
                cache["v2"] = (raw, GlobalPosition.from_state(raw, n))
            return cache["v2"][1], ws, rank
        if "v1" in cache and _same_v1(raw, cache["v1"][0]):
            return cache["v1"][1], ws, rank
        old = EpochPosition.from_state(raw, n)
    except ValueError as e:
        raise CorruptCheckpointError(f"{what}: ElasticSampler state: {e}", key="dataloader") from None
    try:
        pos = from_v1(old, n)
    except OutOfStepError as e:
        raise TopologyChangeError(f"{what}: a version-1 ElasticSampler position: {e}", key="dataloader") from None
    except ValueError as e:
        raise CorruptCheckpointError(f"{what}: ElasticSampler position: {e}", key="dataloader") from None
    cache["v1"] = (raw, pos)
    return pos, ws, rank


def saved_consumed(st: dict, since: int, batch_size: Any, share: int, what: str) -> int:
    """The samples a saved rank consumed of its ``share``: ``consumed`` plus, when the loader
    snapshots every few steps, the steps since its snapshot times the batch size (the last
    batch of a share may be short, so that product may exceed the share by less than a
    batch; never more). Without a recorded batch size (a loader with a ``batch_sampler``)
    those steps are not counted, as before: the samples they read are read again.

    Raises:
        CorruptCheckpointError: a count that is not an integer in its range, or a batch size
            that is not a positive integer.
    """
    try:
        if batch_size is not None:  # before anything multiplies by it
            saved_int(batch_size, 1, MAX_STEPS, "the metadata's batch_size")
        consumed = saved_int(st.get("consumed"), 0, share, f"consumed (of a share of {share})")
        saved_int(since, 0, share, f"_steps_since_snapshot (of a share of {share})")
        total = consumed + since * (batch_size or 0)
        if total > share + (batch_size or 1) - 1:
            raise ValueError(
                f"consumed {consumed} + _steps_since_snapshot {since} x batch_size {batch_size} = "
                f"{total} samples, more than the share of {share} and a short last batch"
            )
    except ValueError as e:
        raise CorruptCheckpointError(f"{what}: ElasticSampler state: {e}", key="dataloader") from None
    return min(total, share)


def _same_v1(raw: Any, checked: dict) -> bool:
    """Whether a saved version-1 position equals one already checked (``checked``): its epoch and
    segments, and its bitmap, a tensor equal to the checked one's (or both ``None``)."""
    if not isinstance(raw, dict) or raw.get("epoch") != checked["epoch"] or raw.get("segments") != checked["segments"]:
        return False
    a, b = raw.get("done"), checked["done"]
    return (a is None and b is None) or (
        isinstance(a, torch.Tensor)
        and b is not None
        and a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a, b)
    )
