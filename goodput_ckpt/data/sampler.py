"""``ElasticSampler``: a ``DistributedSampler`` whose position survives a change of world size,
worker count or batch size.

How the position reaches a checkpoint: torchdata's ``StatefulDataLoader`` asks the *sampler
iterator* for its ``state_dict()`` (it is ``Stateful``) in the main process, right after it drew
a batch's indices, and keeps that snapshot until the batch is yielded to the training loop. With
``num_workers=0`` nothing is drawn ahead; with workers, indices of prefetched batches are drawn
early but the loader's ``state_dict()`` returns the snapshot of the last *yielded* batch. So the
saved ``consumed`` count is what the training loop received, never what workers prefetched.

Restores:

- Same world size, worker count and batch size: the loader restores its own state as always
  (bit-exact, worker RNG seeds included), and the iterator's ``load_state_dict`` takes it up.
- Anything else: ``CheckpointManager.restore`` hands the loader states of *all* old ranks to
  :meth:`ElasticSampler.elastic_resume`, which advances the epoch's global record
  (:class:`~.global_position.GlobalPosition`: the consumed prefix of the permutation and a few
  exceptions) by their counts and leaves the pending samples to the next ``iter()``; the loader
  itself starts a fresh iterator.

The iterator's saved state (version 2) is the record, the same on every rank, plus this rank's
own count. A ``CheckpointManager`` save stores the record once per job, in its commit record, and
each rank's row only its count (:mod:`._sampler_state`: :meth:`ElasticSampler.split_job_state`,
:meth:`ElasticSampler.join_job_state`). Version-1 states (a segment history) are still read,
converted by :func:`.migrate.from_v1`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ..errors import CheckpointError, TopologyChangeError
from . import _sampler_state as saved
from ._sampler_state import MARK, READS, VERSION, share_size
from .global_position import GlobalPosition, OutOfStepError
from .position import epoch_order

__all__ = ["MARK", "READS", "VERSION", "ElasticSampler"]


class ElasticSampler(Sampler[int]):
    """Drop-in for ``torch.utils.data.DistributedSampler`` with a global, reshardable position.

    Every rank computes the same permutation per ``(seed, epoch)`` (the one ``DistributedSampler``
    computes) and reads positions ``rank, rank + W, ...`` of the samples still pending in it.

    Args:
        dataset: a sized (map-style) dataset.
        shuffle: permute each epoch; otherwise read in index order.
        seed: base of the per-epoch permutation (``seed + epoch``); every rank must pass the same.
        drop_last: each rank reads ``pending // W`` samples and the tail (fewer than ``W``) is not
            read in this epoch; otherwise the pending list is padded by repeating its start so
            that every rank reads ``ceil(pending / W)`` (a few samples twice, as
            ``DistributedSampler`` does, so that no rank runs a step fewer).
        num_replicas, rank: default to the default process group's (or 1 and 0 without one).
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.epoch = 0
        self._pending: GlobalPosition | None = None  # a restored position, for the next iter()
        #: After a same-topology restore (:meth:`adopt_saved_epoch`): the saved epoch, whose
        #: position the loader applies to the next iterator unless ``set_epoch`` chose another.
        self._saved_epoch: int | None = None
        self._order: tuple[tuple[int, int] | None, torch.Tensor | None] = (None, None)  # (n, epoch) -> permutation
        #: The last job-level record joined (``join_job_state``), checked: (record, fields, digest).
        self._joined: tuple[Any, dict, str] | None = None

    # -- the DistributedSampler interface ---------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next ``iter()`` reads. Setting the epoch a restore left keeps the
        restored position; any other epoch starts from its beginning, after an elastic restore
        and after a same-topology one alike (the loader's saved position is then not applied)."""
        if epoch != self.epoch:
            self._pending = None
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Samples the next ``iter()`` yields on this rank (fewer than a full epoch's share after a
        restore in the middle of one)."""
        return len(self._positions(self._next_position()))

    def __iter__(self) -> Iterator[int]:
        return _ElasticIterator(self, self._next_position())

    # -- the position -----------------------------------------------------------------------
    def _next_position(self) -> GlobalPosition:
        if self._pending is not None and self._pending.epoch == self.epoch:
            return self._pending
        return GlobalPosition(self.epoch)

    def _positions(self, position: GlobalPosition) -> torch.Tensor:
        """The dataset indices this rank reads from ``position``, in order: its share of the
        pending part of the epoch's permutation (O(the share) once the permutation is drawn)."""
        key = (len(self.dataset), position.epoch)
        if self._order[0] != key:  # the loader calls iter() up to three times per epoch
            self._order = (key, epoch_order(key[0], seed=self.seed, epoch=key[1], shuffle=self.shuffle))
        share = position.share(key[0], self.num_replicas, self.rank, drop_last=self.drop_last)
        return self._order[1][share]

    def _identity(self) -> dict[str, Any]:
        return {"seed": self.seed, "n": len(self.dataset), "shuffle": self.shuffle, "drop_last": self.drop_last}

    def _check_identity(self, state: dict, where: str) -> None:
        saved = {k: state.get(k) for k in self._identity()}
        if saved != self._identity():
            diffs = ", ".join(f"{k} {saved[k]!r} -> {v!r}" for k, v in self._identity().items() if saved[k] != v)
            raise CheckpointError(
                f"{where}: the ElasticSampler differs from the saved one ({diffs}); the saved position "
                "names samples of another permutation and cannot be applied",
                key="dataloader",
            )

    @staticmethod
    def find_state(loader_state: Any, what: str = "the dataloader state") -> tuple[dict, int] | None:
        """This sampler's iterator state inside a decoded ``StatefulDataLoader`` state, and the
        loader's steps since that snapshot (``snapshot_every_n_steps`` > 1); ``None`` if absent.
        The walk is bounded (``find_marked``); ``what`` names the state in errors.

        Raises:
            CheckpointError: more than one sampler state in one loader state.
            CorruptCheckpointError: the state contains itself or nests too deeply, or its steps
                since the snapshot are not a non-negative integer.
        """
        return saved.find_state(loader_state, what)

    # -- the job-level record: what a save stores once per job (``_sampler_state``) -------------
    @staticmethod
    def split_job_state(loader_state: Any) -> tuple[Any, dict | None]:
        """``(what this rank's row keeps, the job-level record)`` of a live loader state: the
        record (identity, world size, global position: a few hundred bytes at most) is the same
        on every rank and is stored once per job; the row keeps this rank's rank and count.
        ``CheckpointManager.save`` calls this (``state.dataloader.split_loader_state``)."""
        return saved.split_job_state(loader_state)

    def join_job_state(self, loader_state: Any, job: Any, *, where: str = "checkpoint") -> Any:
        """A decoded row's state with its part joined to the job-level record ``job`` (read from
        the commit record, checked here), in place; as it is when it holds no such part.

        Raises:
            CorruptCheckpointError, CheckpointError, TopologyChangeError: see
                :func:`._sampler_state.join_job_state`.
        """
        return saved.join_job_state(self, loader_state, job, where=where)

    def check_saved_state(self, loader_state: Any, *, batch_size: Any = None, where: str = "checkpoint") -> None:
        """Before a same-topology restore applies ``loader_state`` (``CheckpointManager.restore``
        calls this in the load's read phase, so a bad row fails every rank; ``where`` names the
        location and the row): its sampler state, if it holds one, must be this
        rank's and every count in range, as :meth:`elastic_resume` checks each old rank's.

        Raises:
            TopologyChangeError: the state is another rank's or world size's.
            CheckpointError, CorruptCheckpointError: as :meth:`elastic_resume`.
        """
        what = where  # the manager names the location and the row
        got = self.find_state(loader_state, what)
        if got is None:
            return
        st, since = got
        pos, ws, rank = saved.saved_position(self, st, what)
        if (ws, rank) != (self.num_replicas, self.rank):
            raise TopologyChangeError(
                f"{what}: an ElasticSampler state of rank {rank} of {ws} for rank {self.rank} of {self.num_replicas}",
                path=where,
                key="dataloader",
            )
        share = share_size(pos.pending_count(len(self.dataset)), ws, drop_last=self.drop_last)
        saved.saved_consumed(st, since, batch_size, share, what)

    def adopt_saved_epoch(self, loader_state: Any) -> None:
        """After a same-topology restore: make ``epoch`` the saved one at once (the loader itself
        applies the saved state lazily, when its next iterator starts)."""
        got = self.find_state(loader_state)
        if got is None:
            return
        pos, _, _ = saved.saved_position(self, got[0], "the dataloader state")
        self._pending, self.epoch, self._saved_epoch = None, pos.epoch, pos.epoch
        share = share_size(pos.pending_count(len(self.dataset)), self.num_replicas, drop_last=self.drop_last)
        consumed = saved.saved_consumed(got[0], 0, None, share, "the dataloader state")
        if consumed >= share:
            # The save came after this rank's last sample of the epoch, and so after every
            # rank's (shares are equal and steps synchronous). The loader may start a fresh
            # iterator instead of applying the saved one: it must find the epoch read, as the
            # elastic path does, not read it again.
            self._pending = pos.advanced(self.num_replicas, [share] * self.num_replicas, len(self.dataset))

    def elastic_resume(self, loader_states: list[Any], *, batch_size: int | None, where: str = "checkpoint") -> str:
        """Take up the global position saved by all old ranks (``loader_states[r]`` is old
        checkpoint rank ``r``'s decoded loader state); the next ``iter()`` splits the pending
        samples among the current ranks. Returns a note saying what was resumed.
        :meth:`prepare_elastic_resume`, then its result called.
        """
        return self.prepare_elastic_resume(loader_states, batch_size=batch_size, where=where)()

    def prepare_elastic_resume(
        self, loader_states: list[Any], *, batch_size: Any, where: str = "checkpoint"
    ) -> Callable[[], str]:
        """Check every old rank's state and compute the new position, changing nothing; returns
        the function that applies it (and returns the note). ``CheckpointManager.restore`` calls
        this before it loads anything, and the result once everything else is loaded.

        The old sampler ranks are those the states name: with tensor or pipeline parallelism
        several checkpoint ranks share one data-parallel sampler rank (and must agree on it).

        Raises:
            TopologyChangeError: the old ranks do not agree on the epoch or history, a sampler
                rank is missing, or one state holds no ElasticSampler position.
            CheckpointError: the sampler differs (seed, dataset size, shuffle, drop_last).
            CorruptCheckpointError: a count, the position or the batch size is malformed or out
                of range, naming the old rank's row and the field.
        """
        base: GlobalPosition | None = None
        length = 0  # samples pending at ``base``
        by_rank: dict[int, int] = {}  # sampler rank -> samples consumed
        old_ws = None
        cache: dict = {}  # the position every old rank saved, parsed once
        for r, ls in enumerate(loader_states):
            what = f"{where}: the dataloader row of old rank {r}"
            got = self.find_state(ls, what)
            if got is None:
                raise TopologyChangeError(f"{what} holds no ElasticSampler position", path=where, key="dataloader")
            st, since = got
            pos, ws, rank = saved.saved_position(self, st, what, cache)
            if base is None:
                base, length, old_ws = pos, pos.pending_count(len(self.dataset)), ws
            in_step = ws == old_ws and pos == base
            if in_step:  # counted against the share of its position: the one every rank saved
                consumed = saved.saved_consumed(
                    st, since, batch_size, share_size(length, ws, drop_last=self.drop_last), what
                )
            if not in_step or by_rank.get(rank, consumed) != consumed:
                raise TopologyChangeError(
                    f"{where}: old rank {r} saved another data position (sampler rank {rank} of {ws}, epoch "
                    f"{pos.epoch}) than the ranks before it (epoch {base.epoch}); the ranks were not in step",
                    path=where,
                    key="dataloader",
                )
            by_rank[rank] = consumed
        if base is None or old_ws is None:
            raise TopologyChangeError(f"{where}: no old rank's dataloader state", path=where, key="dataloader")
        if len(by_rank) != old_ws:  # every key is a rank in [0, old_ws)
            raise TopologyChangeError(
                f"{where}: the checkpoint holds the positions of sampler ranks {sorted(by_rank)[:16]}, not all of "
                f"0..{old_ws - 1}",
                path=where,
                key="dataloader",
            )
        n = len(self.dataset)
        counts = [by_rank[r] for r in range(old_ws)]
        try:
            new = base.advanced(old_ws, counts, n)
        except OutOfStepError as e:
            raise TopologyChangeError(
                f"{where}: the old ranks were not in step: {e}", path=where, key="dataloader"
            ) from None
        left = new.pending_count(n)
        note = (
            f"data position taken up elastically: epoch {new.epoch}, {sum(counts)} sample(s) consumed "
            f"by {old_ws} old sampler rank(s) in the last stretch, {left} of {n} pending, split among "
            f"{self.num_replicas} rank(s)"
        )

        def apply() -> str:
            self._pending, self.epoch, self._saved_epoch = new, new.epoch, None
            return note

        return apply


class _ElasticIterator(Iterator[int]):
    """One pass over this rank's share of a position; ``Stateful`` for ``StatefulDataLoader``."""

    def __init__(self, sampler: ElasticSampler, position: GlobalPosition) -> None:
        self.sampler = sampler
        self._set(position, 0)

    def _set(self, position: GlobalPosition, consumed: int, indices: torch.Tensor | None = None) -> None:
        """Read ``position`` from its ``consumed``-th sample on (``indices``: its share, if known;
        ``consumed`` was checked against it)."""
        self.position = position
        self.indices = (self.sampler._positions(position) if indices is None else indices).tolist()
        self.consumed = consumed

    def __iter__(self) -> _ElasticIterator:
        return self

    def __next__(self) -> int:
        if self.consumed >= len(self.indices):
            s = self.sampler
            if s._pending is not None and s._pending.epoch == self.position.epoch:
                s._pending = None  # the restored rest of this epoch is read; a new iter() starts it anew
            raise StopIteration
        self.consumed += 1
        return self.indices[self.consumed - 1]

    def state_dict(self) -> dict[str, Any]:
        s = self.sampler
        return {
            MARK: VERSION,
            **s._identity(),
            "world_size": s.num_replicas,
            "rank": s.rank,
            "position": self.position.to_state(),
            "consumed": self.consumed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Same-topology restore through the loader (the elastic path goes through
        :meth:`ElasticSampler.elastic_resume` instead): checked as that path checks each old
        rank's state (``_sampler_state.saved_position``, ``saved_consumed``)."""
        s = self.sampler
        what = "the dataloader state"
        pos, ws, rank = saved.saved_position(s, state, what)
        if (ws, rank) != (s.num_replicas, s.rank):
            raise TopologyChangeError(
                f"ElasticSampler state of rank {rank} of {ws} loaded into "
                f"rank {s.rank} of {s.num_replicas}; restore it through CheckpointManager.restore",
                key="dataloader",
            )
        saved_epoch, s._saved_epoch = s._saved_epoch, None
        if saved_epoch is not None and s.epoch != saved_epoch:
            return  # set_epoch chose another epoch since the restore: it starts from its beginning
        indices = s._positions(pos)
        consumed = saved.saved_consumed(state, 0, None, indices.numel(), what)
        s.epoch = pos.epoch
        self._set(pos, consumed, indices)
