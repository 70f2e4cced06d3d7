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

import re
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError
from ..format.schema import MAX_FILE_BYTES
from ._saved import saved_int

__all__ = ["check_token_identity", "checked_token_counts"]

_INDEX = re.compile(r"(0|[1-9][0-9]{0,9})")  # str(i) of a shard index, ASCII


def check_token_identity(state: Any, mark: str, version: int, identity: dict[str, Any], what: str) -> None:
    """Refuse a state of another version, or of other shards, ``seq_len`` or dtype.

    Raises:
        CheckpointError: naming ``what``.
    """
    if not isinstance(state, dict) or state.get(mark) != version:
        got = state.get(mark) if isinstance(state, dict) else None
        raise CheckpointError(f"{what}: TokenStream state version {got!r:.40} is not supported", key="dataloader")
    saved = {k: state.get(k) for k in identity}
    if saved != identity:
        raise CheckpointError(
            f"{what}: the TokenStream differs from the saved one (shards, seq_len or dtype); "
            "its per-shard counts cannot be applied",
            key="dataloader",
        )


def checked_token_counts(
    state: dict, shards: list[str], lengths: list[int], sizes: list[int], what: str
) -> tuple[list[int], dict[int, int]]:
    """The saved ``(base, progress)`` counts, checked against the shards as they are now
    (``lengths`` in sequences, ``sizes`` in bytes) before they index or position anything.

    Raises:
        CorruptCheckpointError: a count or index out of range or of the wrong type, naming
            ``what`` and the field.
        CheckpointError: a shard's size differs from the one the state recorded (replaced).
    """
    n = len(shards)
    base_raw, progress_raw, saved_sizes = state.get("base"), state.get("progress"), state.get("sizes")
    try:
        if not isinstance(base_raw, (list, tuple)) or len(base_raw) != n:
            raise ValueError(f"base must be a list of {n} count(s), one per shard")
        if not isinstance(progress_raw, dict) or len(progress_raw) > n:
            raise ValueError(f"progress must be a dict of at most {n} shard(s)")
        if saved_sizes is not None and (not isinstance(saved_sizes, (list, tuple)) or len(saved_sizes) != n):
            raise ValueError(f"sizes must be a list of {n} byte count(s), one per shard")
        for i, s in enumerate(saved_sizes or ()):
            saved_int(s, 0, MAX_FILE_BYTES, f"sizes[{i}]")
        _check_sizes(saved_sizes or (), sizes, shards, what)
        base = [
            saved_int(c, 0, lengths[i], f"base[{i}] (shard {shards[i]!r} holds {lengths[i]})")
            for i, c in enumerate(base_raw)
        ]
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


def _check_sizes(saved: Any, sizes: list[int], shards: list[str], what: str) -> None:
    for i, (was, now) in enumerate(zip(saved, sizes)):
        if was != now:
            raise CheckpointError(
                f"{what}: token shard {shards[i]!r} is {now} bytes, {was} when the state was saved: it was "
                "replaced under the same name, so its saved count does not name the same sequences. Put the "
                "original shard back, or start the stream from its beginning (restore without dataloader=)",
                key="dataloader",
            )
