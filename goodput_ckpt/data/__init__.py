"""Elastic data-pipeline pieces to put in a training loader.

- :class:`ElasticSampler`: a ``DistributedSampler`` whose saved position is global (a fixed-size
  record, :class:`GlobalPosition`: the epoch and the consumed prefix of its permutation), so
  ``CheckpointManager.restore`` can resume it under another world size, worker count or batch
  size without repeating or skipping a sample, continuing the one global sample order.
- :func:`sample_generator`: per-sample randomness from ``(seed, epoch, index)``, the same on
  every rank and worker and after any resume.
- :class:`TokenStream`: fixed-length ``uint16``/``uint32`` token sequences over shard files read
  through ``storage/``, with per-shard state that reshards over (rank, worker) pairs.

This package sits beside ``state/``: neither imports the other. The manager's restore finds an
``ElasticSampler`` on a loader by its methods (``find_state``, ``elastic_resume``).
"""

from .global_position import GlobalPosition
from .position import EpochPosition, epoch_order
from .randomness import sample_generator, sample_seed
from .sampler import ElasticSampler
from .tokens import TokenStream

__all__ = [
    "ElasticSampler",
    "EpochPosition",
    "GlobalPosition",
    "TokenStream",
    "epoch_order",
    "sample_generator",
    "sample_seed",
]
