"""The training-state bundle: model and optimizer (through torch's state-dict helpers), per-rank
RNG, per-rank dataloader state, other stateful objects and user metadata.

:mod:`.bundle` builds the state dict of one save and plans a restore, :mod:`.apply` applies it; :mod:`.rng`,
:mod:`.dataloader` and :mod:`.modules` each handle one kind of state. The manager sits above.
"""

from .apply import apply_restore
from .bundle import (
    EXTRA_KEY,
    META_KEY,
    RESERVED_NAMES,
    SCHEMA_VERSION,
    RestorePlan,
    Topology,
    build_save_state,
    check_stateful,
    plan_restore,
    rank_key,
    training_meta,
)
from .modules import ModelSet, normalize

__all__ = [
    "EXTRA_KEY",
    "META_KEY",
    "RESERVED_NAMES",
    "SCHEMA_VERSION",
    "ModelSet",
    "RestorePlan",
    "Topology",
    "apply_restore",
    "build_save_state",
    "check_stateful",
    "normalize",
    "plan_restore",
    "rank_key",
    "training_meta",
]
