"""Which steps under a manager root other steps still need: an incremental save's manifest
references data files of earlier steps (docs/format.md, "References"), and those steps must
outlive every kept step that references them.

Retention (:mod:`.retention`) asks :func:`protected_steps` before it deletes anything, on every
root, whether or not this process saves incrementally: a root may hold incremental steps of an
earlier run. The rule: a step is deleted only when no step that stays references it; a kept
step whose commit record cannot be read (damaged, a version this library does not know,
unreadable) protects every other step, since what it references is unknown. Then
:func:`referrers_first` orders the deletions so that a step goes before every step it
references. Both decide from the references alone, never from step numbers: a base is usually
an earlier step, but not always (a job rolled back that saves lower step numbers again
references the higher step it saved last).

A committed manifest does not change, so the bases of each step are remembered per process
(bounded): each retention reads the record of the step it just committed and of kept steps it
has not read before, not all of them again. The step just committed is always read afresh (an
overwrite of the same step may have changed it). No torch here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable

from ..errors import CheckpointError
from ..format.commit_record import COMMITTED, CORRUPT, UNSUPPORTED, read_commit_record
from ..format.manifest import MANIFEST_NAME
from ..format.references import sealed_bases
from ..storage.base import Store
from .step_layout import parse_step_dir, step_dir_name

__all__ = ["protected_steps", "referrers_first"]

#: Steps whose bases are remembered, over all roots of the process (each entry a few names).
_CACHE_SIZE = 4096
_cache: OrderedDict[tuple[str, int], frozenset[int] | None] = OrderedDict()
_lock = threading.Lock()


def protected_steps(
    root: Store,
    files: dict[int, list[str]],
    kept: Iterable[int],
    *,
    fresh: Collection[int] = (),
    doomed: Collection[int] | None = None,
    records: dict[int, bytes] | None = None,
) -> set[int]:
    """The steps that the complete steps ``kept`` reference, directly or through one another.

    ``files``: the root's listing by step (:func:`~.step_layout.list_step_dirs`); ``fresh``:
    steps whose record is read again even if remembered; ``doomed``: the steps the caller
    means to delete, when it only asks which of them to spare: the walk stops once all of
    them are protected, since reading more records could only protect more. ``records``: when
    given, every commit record read here is added to it (step -> its bytes), for a caller that
    reads one of them next (a restore's load of the newest step takes it from there: one read);
    a record it holds already is taken from it, not read (retention after a commit: the record
    the save wrote).

    Why newest first and the early stop: a restore's clean-up of a root whose newest step is
    incremental read the record of every kept step and of the base (3 ``GET`` requests on S3
    for ``keep_last=2``) before the load read the newest record again. The newest step is the
    one most likely to name the doomed base; once it does, nothing else is read (1 request).
    """
    protected: set[int] = set()
    todo = sorted(set(kept))  # popped from the end: newest first
    seen: set[int] = set()
    wanted = None if doomed is None else set(doomed)
    while todo:  # bounded: each step is visited once
        if wanted is not None and wanted <= protected:
            break  # every step the caller asked about is spared already
        step = todo.pop()
        if step in seen:
            continue
        seen.add(step)
        bases = _bases(root, step, files.get(step, []), refresh=step in fresh, records=records)
        if bases is None:  # unknown references: every other step stays, whatever its number
            bases = frozenset(s for s in files if s != step)
        for b in bases:
            if b not in protected:
                protected.add(b)
                todo.append(b)
    return protected


def referrers_first(root: Store, files: dict[int, list[str]], victims: Collection[int]) -> list[int]:
    """``victims`` in an order of deletion where each step comes before every victim it
    references (newest first among steps free to go), so that a crash between two deletions
    never leaves a complete step whose base is gone, whatever the step numbers.

    ``files``: the root's listing by step. The victims' records are read only when there are
    two or more (usually remembered already: each was read when it was committed); a victim
    whose references are unknown references nothing here (its record cannot be loaded either).
    Saves reference committed steps only, so references form no cycle; should a damaged root
    show one anyway, the rest goes newest first.
    """
    order = sorted(set(victims), reverse=True)
    if len(order) < 2:
        return order
    among = set(order)
    refs = {
        v: (_bases(root, v, files.get(v, []), refresh=False, records=None) or frozenset()) & among - {v} for v in order
    }
    referrers = {v: sum(v in r for r in refs.values()) for v in order}  # victims that reference v
    out: list[int] = []
    left = list(order)  # newest first
    while left:  # bounded: each pass removes one step
        step = next((v for v in left if referrers[v] == 0), left[0])  # left[0]: a cycle
        left.remove(step)
        out.append(step)
        for b in refs[step]:
            referrers[b] -= 1
    return out


def _read(root: Store, step: int, names: list[str]) -> bytes | None:
    """The step's commit record's bytes; ``None``: none in the listing, or unreadable (the
    full read below says which)."""
    if MANIFEST_NAME not in names:
        return None
    try:
        return root.read_small(f"{step_dir_name(step)}/{MANIFEST_NAME}")
    except CheckpointError:
        return None


def _bases(
    root: Store, step: int, names: list[str], *, refresh: bool, records: dict[int, bytes] | None
) -> frozenset[int] | None:
    key = (root.uri, step)
    with _lock:
        if not refresh and key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    # A record the caller holds already (the one its save just committed) is not read again.
    data = records.get(step) if records is not None else None
    if data is None:
        data = _read(root, step, names)
    if data is not None and records is not None:
        records[step] = data
    # Read without a full parse (sealed_bases) where the record is sealed; else in full.
    named = None if data is None else sealed_bases(data)
    if named is None:  # not a sealed record of a known version: the full read says what it is
        try:
            record = read_commit_record(root, step_dir_name(step), listing=names, count_files=False, data=data)
        except CheckpointError:
            return None  # unreadable now: not remembered, asked again next time
        if record.status in (CORRUPT, UNSUPPORTED):
            return None  # a step that is complete but whose references cannot be known
        if record.status != COMMITTED:
            return frozenset()  # deleted since the listing, or not a commit: it references nothing
        named = frozenset(record.manifest.bases())
    steps = {parse_step_dir(b) for b in named}
    # A base that is not a step of this root cannot be protected here: nothing deletes it either.
    bases = frozenset(s for s in steps if s is not None)
    with _lock:
        _cache[key] = bases
        _cache.move_to_end(key)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return bases
