"""A ``TokenStream``'s position: its saved state, the checks before it is used, the split into a
job-level record and each reader's part, and the elastic restore (:mod:`.tokens` has the
module docstring's *State* and cost; :mod:`._token_state` the checks and the split).

A mixin, so that the stream's reading (:mod:`.tokens`) and its position each have one home;
it uses the stream's ``shards``, ``seq_len``, ``dtype``, ``lengths()`` and the counts it keeps
(``_base``, ``_progress``, ``_live``, ``_slot``, ``_sizes``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import TopologyChangeError
from ._marked import find_marked
from ._token_state import check_token_identity, checked_token_counts, join_token_states, split_token_states

__all__ = ["MARK", "VERSION", "TokenPosition"]

MARK = "goodput_token_stream"
VERSION = 1


class TokenPosition:
    """The position methods of :class:`.tokens.TokenStream`."""

    shards: list[str]
    seq_len: int
    dtype: str
    num_replicas: int
    _base: list[int]
    _progress: dict[int, int]
    _live: Any
    _slot: tuple[int, int, int, int]
    _sizes: list[int] | None

    def lengths(self, store: Any = None) -> list[int]:
        """Sequences per shard: :meth:`.tokens.TokenStream.lengths` (which overrides this)."""
        raise NotImplementedError

    def _identity(self) -> dict[str, Any]:
        return {"shards": list(self.shards), "seq_len": self.seq_len, "dtype": self.dtype}

    def state_dict(self) -> dict[str, Any]:
        progress = dict(self._progress)
        if self._live is not None:
            i, start, step, n, it = self._live
            progress[i] = start + (n - it.__length_hint__()) * step
        return {
            MARK: VERSION,
            **self._identity(),
            "slot": list(self._slot),
            "base": list(self._base),
            "progress": {str(i): c for i, c in progress.items()},
            # What the counts were taken of: a shard replaced under its name is refused by it.
            **({"sizes": list(self._sizes)} if self._sizes is not None else {}),
        }

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (into loader workers) without the block being yielded from: its count is
        folded in, its views are not sent."""
        state = self.__dict__.copy()
        state.pop("_join_cache", None)  # a restore's checked record: the workers need none
        if self._live is not None:
            state["_progress"] = {int(k): v for k, v in self.state_dict()["progress"].items()}
            state["_live"] = None
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Same-topology restore (through the loader, inside each worker)."""
        self._base, self._progress = self._saved(state, "the dataloader state")
        self._live = None

    def _saved(self, state: Any, what: str, cache: dict | None = None) -> tuple[list[int], dict[int, int]]:
        """A saved state's ``(base, progress)``, after its identity, and every count checked
        against the shards as they are now (:mod:`._token_state`; ``cache``: the readers of one
        restore share their joined ``base``, checked once); one check for both restore paths."""
        check_token_identity(state, MARK, VERSION, self._identity(), what)
        lengths = self.lengths()
        assert self._sizes is not None
        return checked_token_counts(state, self.shards, lengths, self._sizes, what, cache)

    @staticmethod
    def split_job_state(loader_state: Any) -> tuple[Any, dict | None]:
        """``(what this rank's row keeps, the job-level record)``: the identity, base counts and
        sizes every reader shares go once per job into the commit record; each reader's part
        keeps its own shards' counts (``state.dataloader.split_loader_state``)."""
        return split_token_states(loader_state, MARK, VERSION)

    def join_job_state(self, loader_state: Any, job: Any, *, where: str = "checkpoint") -> Any:
        """A decoded row's readers joined to the job-level record ``job`` (checked), in place.

        Raises:
            CorruptCheckpointError, CheckpointError, TopologyChangeError: see
                :func:`._token_state.join_token_states`.
        """
        cache = self.__dict__.setdefault("_join_cache", {})  # not pickled into workers (__getstate__)
        return join_token_states(
            loader_state, job, mark=MARK, version=VERSION, identity=self._identity(), where=where, cache=cache
        )

    @staticmethod
    def find_states(loader_state: Any, what: str = "the dataloader state") -> list[dict]:
        """Every TokenStream state inside a decoded loader state (one per worker), found by a bounded walk."""
        return find_marked(loader_state, MARK, what)

    def check_saved_state(self, loader_state: Any, *, batch_size: Any = None, where: str = "checkpoint") -> None:
        """Before a same-topology restore applies ``loader_state`` (``CheckpointManager.restore``
        calls this in the load's read phase, so a bad row fails every rank; ``where`` names the
        location and the row): every TokenStream state in it checked as
        :meth:`load_state_dict` will check it in the workers.

        Raises:
            CorruptCheckpointError, CheckpointError: see :mod:`._token_state`.
        """
        del batch_size  # counts are per sequence
        what = where  # the manager names the location and the row
        for st in self.find_states(loader_state, what):
            self._saved(st, what)

    def elastic_resume(
        self, loader_states: list[Any], *, batch_size: int | None = None, where: str = "checkpoint"
    ) -> str:
        """Take up the per-shard counts of all old ranks' readers (module docstring; checked and
        merged by :meth:`prepare_elastic_resume`); the next ``iter()`` deals the unfinished shards."""
        return self.prepare_elastic_resume(loader_states, batch_size=batch_size, where=where)()

    def prepare_elastic_resume(
        self, loader_states: list[Any], *, batch_size: Any = None, where: str = "checkpoint"
    ) -> Callable[[], str]:
        """Check every old rank's states and merge their counts, changing nothing; returns the
        function that applies them (and returns the note).

        Raises:
            TopologyChangeError: no old rank saved a TokenStream state.
            CorruptCheckpointError, CheckpointError: see :mod:`._token_state`, naming the old
                rank's row.
        """
        del batch_size  # counts are per sequence, exact whatever the batch size
        consumed = [0] * len(self.shards)
        found, cache, merged = 0, {}, {}  # a base shared by the readers (joined) is merged once
        for r, ls in enumerate(loader_states):
            what = f"{where}: the dataloader row of old rank {r}"
            for st in self.find_states(ls, what):
                base, progress = self._saved(st, what, cache)
                found += 1
                if id(base) not in merged:
                    merged[id(base)] = base  # held, so that its id is not reused
                    consumed = [max(a, b) for a, b in zip(consumed, base)]
                for i, c in progress.items():
                    consumed[i] = max(consumed[i], c)
        if not found:
            raise TopologyChangeError(f"{where}: the dataloader states hold no TokenStream state", path=where)
        lengths = self.lengths()
        note = (
            f"token stream taken up elastically: {sum(consumed)} of {sum(lengths)} sequences read, "
            f"{sum(c < n for c, n in zip(consumed, lengths))} unfinished shard(s) dealt over "
            f"{self.num_replicas} rank(s)"
        )

        def apply() -> str:
            self._base, self._progress, self._live = consumed, {}, None
            return note

        return apply
