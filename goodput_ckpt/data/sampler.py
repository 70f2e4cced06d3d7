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
  :meth:`ElasticSampler.elastic_resume`, which records their counts as a segment of the epoch's
  :class:`~.position.EpochPosition` and leaves the pending samples to the next ``iter()``; the
  loader itself starts a fresh iterator.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ..errors import CheckpointError, TopologyChangeError
from ._marked import find_marked
from .position import EpochPosition, epoch_order, rank_share

__all__ = ["ElasticSampler"]

#: Marks the iterator's state dict inside a loader's state, and names its version.
MARK = "goodput_elastic_sampler"
VERSION = 1


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
        self._pending: EpochPosition | None = None  # a restored position, for the next iter()
        #: After a same-topology restore (:meth:`adopt_saved_epoch`): the saved epoch, whose
        #: position the loader applies to the next iterator unless ``set_epoch`` chose another.
        self._saved_epoch: int | None = None
        self._order: tuple[tuple[int, int] | None, torch.Tensor | None] = (None, None)  # (n, epoch) -> permutation

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
    def _next_position(self) -> EpochPosition:
        if self._pending is not None and self._pending.epoch == self.epoch:
            return self._pending
        return EpochPosition(self.epoch)

    def _positions(self, position: EpochPosition) -> torch.Tensor:
        """The dataset indices this rank reads from ``position``, in order."""
        key = (len(self.dataset), position.epoch)
        if self._order[0] != key:  # the loader calls iter() up to three times per epoch
            self._order = (key, epoch_order(key[0], seed=self.seed, epoch=key[1], shuffle=self.shuffle))
        order = self._order[1]
        try:
            pending = position.pending(order)
        except ValueError as e:
            raise CheckpointError(f"ElasticSampler: the restored data position is inconsistent: {e}") from None
        return pending[rank_share(pending.numel(), self.num_replicas, self.rank, drop_last=self.drop_last)]

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
    def find_state(loader_state: Any) -> tuple[dict, int] | None:
        """This sampler's iterator state inside a decoded ``StatefulDataLoader`` state, and the
        loader's steps since that snapshot (``snapshot_every_n_steps`` > 1); ``None`` if absent.

        Raises:
            CheckpointError: more than one sampler state in one loader state.
        """
        found = find_marked(loader_state, MARK)
        if not found:
            return None
        if len(found) > 1:
            raise CheckpointError(f"a dataloader state holds {len(found)} ElasticSampler states; expected one")
        since = loader_state.get("_steps_since_snapshot", 0) if isinstance(loader_state, dict) else 0
        return found[0], int(since or 0)

    def adopt_saved_epoch(self, loader_state: Any) -> None:
        """After a same-topology restore: make ``epoch`` the saved one at once (the loader itself
        applies the saved state lazily, when its next iterator starts)."""
        got = self.find_state(loader_state)
        if got is None:
            return
        state = got[0]
        self._check_identity(state, "the dataloader state")
        try:
            pos = EpochPosition.from_state(state["position"])
            consumed = int(state["consumed"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"the dataloader state's ElasticSampler position: {e}", key="dataloader") from None
        self._pending, self.epoch, self._saved_epoch = None, pos.epoch, pos.epoch
        share = len(self._positions(pos))
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

        The old sampler ranks are those the states name: with tensor or pipeline parallelism
        several checkpoint ranks share one data-parallel sampler rank (and must agree on it).

        Raises:
            TopologyChangeError: the old ranks do not agree on the epoch or history, a sampler
                rank is missing, or one state holds no ElasticSampler position.
            CheckpointError: the sampler differs (seed, dataset size, shuffle, drop_last).
        """
        base: EpochPosition | None = None
        by_rank: dict[int, int] = {}  # sampler rank -> samples consumed
        old_ws = None
        for r, ls in enumerate(loader_states):
            got = self.find_state(ls)
            if got is None:
                raise TopologyChangeError(
                    f"{where}: rank {r}'s dataloader state holds no ElasticSampler position", path=where, key="dataloader"
                )
            st, since = got
            if st.get(MARK) != VERSION:
                raise CheckpointError(
                    f"{where}: ElasticSampler state version {st.get(MARK)!r} is not supported (this "
                    f"goodput-ckpt reads {VERSION})",
                    version=st.get(MARK),
                )
            self._check_identity(st, where)
            try:
                pos = EpochPosition.from_state(st["position"])
                ws, rank, consumed = int(st["world_size"]), int(st["rank"]), int(st["consumed"]) + since * (batch_size or 0)
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{where}: rank {r}'s ElasticSampler state: {e}", key="dataloader") from None
            old_ws = ws if old_ws is None else old_ws
            if base is None:
                base = pos
            if (
                ws != old_ws
                or (pos.epoch, pos.segments) != (base.epoch, base.segments)
                or not _same(pos.done, base.done)
                or by_rank.get(rank, consumed) != consumed
            ):
                raise TopologyChangeError(
                    f"{where}: old rank {r} saved another data position (sampler rank {rank} of {ws}, epoch "
                    f"{pos.epoch}) than the ranks before it (epoch {base.epoch}); the ranks were not in step",
                    path=where,
                    key="dataloader",
                )
            by_rank[rank] = consumed
        assert base is not None and old_ws is not None
        if sorted(by_rank) != list(range(old_ws)):
            raise TopologyChangeError(
                f"{where}: the checkpoint holds the positions of sampler ranks {sorted(by_rank)}, not all of 0..{old_ws - 1}",
                path=where,
                key="dataloader",
            )
        n = len(self.dataset)
        length = base.pending(torch.arange(n)).numel()  # once: O(n), whatever the old world size
        counts = [min(by_rank[r], rank_share(length, old_ws, r, drop_last=self.drop_last).numel()) for r in range(old_ws)]
        new = base.advanced(old_ws, counts, n)
        self._pending, self.epoch, self._saved_epoch = new, new.epoch, None
        left = new.pending(torch.arange(n)).numel()
        return (
            f"data position taken up elastically: epoch {new.epoch}, {sum(counts)} sample(s) consumed "
            f"by {old_ws} old sampler rank(s) in the last stretch, {left} of {n} pending, split among "
            f"{self.num_replicas} rank(s)"
        )


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


class _ElasticIterator(Iterator[int]):
    """One pass over this rank's share of a position; ``Stateful`` for ``StatefulDataLoader``."""

    def __init__(self, sampler: ElasticSampler, position: EpochPosition) -> None:
        self.sampler = sampler
        self._set(position, 0)

    def _set(self, position: EpochPosition, consumed: int) -> None:
        self.position = position
        self.indices = self.sampler._positions(position).tolist()
        if not 0 <= consumed <= len(self.indices):
            raise CheckpointError(f"ElasticSampler: {consumed} consumed of a share of {len(self.indices)}")
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
        :meth:`ElasticSampler.elastic_resume` instead)."""
        s = self.sampler
        if state.get(MARK) != VERSION:
            raise CheckpointError(f"ElasticSampler state version {state.get(MARK)!r} is not supported")
        s._check_identity(state, "the dataloader state")
        if (state.get("world_size"), state.get("rank")) != (s.num_replicas, s.rank):
            raise TopologyChangeError(
                f"ElasticSampler state of rank {state.get('rank')} of {state.get('world_size')} loaded into "
                f"rank {s.rank} of {s.num_replicas}; restore it through CheckpointManager.restore",
                key="dataloader",
            )
        try:
            pos = EpochPosition.from_state(state["position"])
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"ElasticSampler state: {e}", key="dataloader") from None
        saved_epoch, s._saved_epoch = s._saved_epoch, None
        if saved_epoch is not None and s.epoch != saved_epoch:
            return  # set_epoch chose another epoch since the restore: it starts from its beginning
        s.epoch = pos.epoch
        self._set(pos, int(state["consumed"]))
