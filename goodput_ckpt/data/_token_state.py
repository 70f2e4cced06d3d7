"""The checks a saved ``TokenStream`` state passes before its counts are used (:mod:`.tokens`).

A state names its shards, ``seq_len`` and dtype (its identity), holds per-shard counts of
sequences read (``base``, ``progress``) and, since this version, each shard's size in bytes when
the state was taken (``sizes``). Before a count indexes a shard or positions a read:

- each count is an integer in [0, the shard's sequences]: a larger one would report a shard as
  read that is not, a negative one or a float would move another position or fail late;
- ``progress`` keys are shard indices written as ``str(i)`` with ``0 <= i < shards``, and a
  reader's progress is not behind the base of its stretch;
- a shard whose size differs from the recorded one was replaced under the same name: its saved
  count no longer names the same sequences, so the restore is refused, naming the shard (put
  the original back, or start a new run over the new data). States saved before sizes were
  recorded carry none: their counts are checked against the shards' current lengths only.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError, TopologyChangeError
from ..format.schema import MAX_FILE_BYTES
from ._marked import find_marked, replace_marked
from ._saved import saved_int

__all__ = ["ROW_VERSION", "check_token_identity", "checked_token_counts", "join_token_states", "split_token_states"]

#: A row's part of a reader's state, joined to the job-level record on restoring (module doc).
ROW_VERSION = 2
_ROW_KEYS = ("slot", "progress", "job")
_JOB_KEYS = ("shards", "seq_len", "dtype", "base", "sizes")

_INDEX = re.compile(r"(0|[1-9][0-9]{0,9})")  # str(i) of a shard index, ASCII


def check_token_identity(state: Any, mark: str, version: int, identity: dict[str, Any], what: str) -> None:
    """Refuse a state of another version, or of other shards, ``seq_len`` or dtype.

    Raises:
        CheckpointError: naming ``what``.
    """
    if not isinstance(state, dict) or state.get(mark) != version:
        got = state.get(mark) if isinstance(state, dict) else None
        if got == ROW_VERSION:
            raise CheckpointError(
                f"{what}: a reader's TokenStream counts without their job-level record; restore them through "
                "CheckpointManager.restore, which joins them",
                key="dataloader",
            )
        raise CheckpointError(f"{what}: TokenStream state version {got!r:.40} is not supported", key="dataloader")
    saved = {k: state.get(k) for k in identity}
    if saved != identity:
        raise CheckpointError(
            f"{what}: the TokenStream differs from the saved one (shards, seq_len or dtype); "
            "its per-shard counts cannot be applied",
            key="dataloader",
        )


def checked_token_counts(
    state: dict, shards: list[str], lengths: list[int], sizes: list[int], what: str, cache: dict | None = None
) -> tuple[list[int], dict[int, int]]:
    """The saved ``(base, progress)`` counts, checked against the shards as they are now
    (``lengths`` in sequences, ``sizes`` in bytes) before they index or position anything.
    ``cache``: shared by the readers of one restore, whose joined states share one ``base`` and
    ``sizes`` list (:func:`join_token_states`): those are checked once, not once per reader.

    Raises:
        CorruptCheckpointError: a count or index out of range or of the wrong type, naming
            ``what`` and the field.
        CheckpointError: a shard's size differs from the one the state recorded (replaced).
    """
    n = len(shards)
    base_raw, progress_raw, saved_sizes = state.get("base"), state.get("progress"), state.get("sizes")
    cache = {} if cache is None else cache
    try:
        hit = cache.get("base")
        if hit is not None and hit[0] is base_raw and hit[1] is saved_sizes:
            base = hit[2]
        else:
            base = _checked_base(base_raw, saved_sizes, shards, lengths, sizes, what)
            cache["base"] = (base_raw, saved_sizes, base)
        if not isinstance(progress_raw, dict) or len(progress_raw) > n:
            raise ValueError(f"progress must be a dict of at most {n} shard(s)")
        progress: dict[int, int] = {}
        for k, c in progress_raw.items():
            if not (isinstance(k, str) and _INDEX.fullmatch(k) and int(k) < n):
                raise ValueError(f"progress key {k!r:.40} is not a shard index in [0, {n})")
            i = int(k)
            field = f"progress[{k!r}] (shard {shards[i]!r} holds {lengths[i]}, base {base[i]})"
            progress[i] = saved_int(c, base[i], lengths[i], field)
    except ValueError as e:
        raise CorruptCheckpointError(
            f"{what}: TokenStream counts do not fit its {n} shard(s): {e}", key="dataloader"
        ) from None
    return base, progress


def _checked_base(
    base_raw: Any, saved_sizes: Any, shards: list[str], lengths: list[int], sizes: list[int], what: str
) -> list[int]:
    """``base`` checked against the shards, after the recorded ``sizes`` (ValueError naming the field)."""
    n = len(shards)
    if not isinstance(base_raw, (list, tuple)) or len(base_raw) != n:
        raise ValueError(f"base must be a list of {n} count(s), one per shard")
    if saved_sizes is not None and (not isinstance(saved_sizes, (list, tuple)) or len(saved_sizes) != n):
        raise ValueError(f"sizes must be a list of {n} byte count(s), one per shard")
    for i, s in enumerate(saved_sizes or ()):
        saved_int(s, 0, MAX_FILE_BYTES, f"sizes[{i}]")
    _check_sizes(saved_sizes or (), sizes, shards, what)
    return [
        saved_int(c, 0, lengths[i], f"base[{i}] (shard {shards[i]!r} holds {lengths[i]})")
        for i, c in enumerate(base_raw)
    ]


def _digest(identity: dict[str, Any], base: list[int]) -> str:
    """16 hex digits naming a job-level record by its identity and base counts."""
    values = [identity["shards"], identity["seq_len"], identity["dtype"], base]
    return hashlib.blake2b(json.dumps(values).encode(), digest_size=8).hexdigest()


def _plain_ints(xs: Any) -> bool:
    return isinstance(xs, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in xs)


def split_token_states(loader_state: Any, mark: str, version: int) -> tuple[Any, dict | None]:
    """``(row state, job-level record)`` of a live loader state holding one or more readers'
    states (module docstring); the state itself and ``None`` when they do not share one identity
    and ``base`` (or hold values a restore refuses: they stay whole in the row). The loader's
    own state is not changed."""
    try:
        found = find_marked(loader_state, mark)
    except CheckpointError:
        return loader_state, None
    if not found or any(d.get(mark) != version for d in found):
        return loader_state, None
    first = found[0]
    identity = {"shards": first.get("shards"), "seq_len": first.get("seq_len"), "dtype": first.get("dtype")}
    base = first.get("base")
    sizes = next((d["sizes"] for d in found if d.get("sizes") is not None), None)
    well_formed = (
        isinstance(identity["shards"], list)
        and all(isinstance(x, str) for x in identity["shards"])
        and _plain_ints([identity["seq_len"]])
        and isinstance(identity["dtype"], str)
        and _plain_ints(base)
        and (sizes is None or _plain_ints(sizes))
    )
    if not well_formed or any({k: d.get(k) for k in identity} != identity or d.get("base") != base for d in found):
        return loader_state, None
    digest = _digest(identity, base)
    job = {mark: ROW_VERSION, **identity, "base": list(base), "sizes": None if sizes is None else list(sizes)}

    def row(d: dict) -> dict:
        return {mark: ROW_VERSION, "slot": d.get("slot"), "progress": d.get("progress"), "job": digest}

    try:
        return replace_marked(loader_state, mark, row), job
    except ValueError:
        return loader_state, None


def join_token_states(
    loader_state: Any, job: Any, *, mark: str, version: int, identity: dict[str, Any], where: str, cache: dict
) -> Any:
    """``loader_state`` (decoded from one row: changed in place) with each reader's row part
    joined to the job-level record ``job`` (manifest metadata, unchecked) into a version-1
    state; as it is when it holds none. The record's identity must be this stream's; its counts
    are checked where they are used (:func:`checked_token_counts`, once for all readers).
    ``cache``: the stream's, so that the rows of one restore check the record (O(shards)) once.

    Raises:
        CorruptCheckpointError: a malformed part or record, or no record.
        CheckpointError: the record is of other shards, ``seq_len`` or dtype.
        TopologyChangeError: a part split from another record (another stretch's or save's).
    """
    rows = [d for d in find_marked(loader_state, mark, where) if d.get(mark) == ROW_VERSION]
    if not rows:
        return loader_state
    if job is None:
        raise CorruptCheckpointError(
            f"{where}: holds a reader's TokenStream counts but the commit record holds no job-level record "
            "(training_state.dataloader.job_position) to join them to",
            key="dataloader",
        )
    if cache.get("job") is not job:
        _check_job(job, mark, version, identity, where)
        cache.update(job=job, digest=_digest(identity, job["base"]))  # holds ``job``: its id stays its own
    base, sizes, digest = job["base"], job["sizes"], cache["digest"]
    for d in rows:
        if set(d) != {mark, *_ROW_KEYS}:
            raise CorruptCheckpointError(
                f"{where}: a reader's TokenStream part must hold {sorted(_ROW_KEYS)}", key="dataloader"
            )
        if d["job"] != digest:
            raise TopologyChangeError(
                f"{where}: a reader's TokenStream counts ({d['job']!r:.24}) were not split from the job's record "
                f"({digest}): the row is another save's or stretch's",
                path=where,
                key="dataloader",
            )
        slot, progress = d["slot"], d["progress"]
        d.clear()
        d.update({mark: version, **identity, "slot": slot, "base": base, "progress": progress})
        if sizes is not None:
            d["sizes"] = sizes  # one list for every reader: checked once (checked_token_counts' cache)
    return loader_state


def _check_job(job: Any, mark: str, version: int, identity: dict[str, Any], where: str) -> None:
    """The job-level record's form, identity (this stream's) and base (integers, one per shard;
    their ranges are checked where they are used)."""
    if not isinstance(job, dict) or job.get(mark) != ROW_VERSION or set(job) != {mark, *_JOB_KEYS}:
        raise CorruptCheckpointError(
            f"{where}: the job-level TokenStream record must be an object of {sorted(_JOB_KEYS)}", key="dataloader"
        )
    check_token_identity({**job, mark: version}, mark, version, identity, where)
    base = job["base"]
    if not isinstance(base, list) or len(base) != len(identity["shards"]) or not _plain_ints(base):
        raise CorruptCheckpointError(
            f"{where}: the job-level TokenStream record's base must be {len(identity['shards'])} integers",
            key="dataloader",
        )


def _check_sizes(saved: Any, sizes: list[int], shards: list[str], what: str) -> None:
    for i, (was, now) in enumerate(zip(saved, sizes)):
        if was != now:
            raise CheckpointError(
                f"{what}: token shard {shards[i]!r} is {now} bytes, {was} when the state was saved: it was "
                "replaced under the same name, so its saved count does not name the same sequences. Put the "
                "original shard back, or start the stream from its beginning (restore without dataloader=)",
                key="dataloader",
            )
