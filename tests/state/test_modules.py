"""Which keys of a model's state dict are tied weights (state/modules.py, ``tied_keys``)."""

from __future__ import annotations

import torch

from goodput_ckpt.state.modules import tied_keys


def test_tied_keys_are_the_same_memory_viewed_the_same_way():
    """Tied: the same storage, offset, shape, strides and dtype; the first key in state-dict
    order is kept. Not tied: equal bytes elsewhere, another offset, a transposed view, another
    dtype; empty and meta tensors are never tied."""
    w = torch.randn(4, 4)
    state = {
        "emb": {"weight": w},
        "head": {"weight": w.detach()},  # a detached view of the same memory: tied
        "copy": w.clone(),  # equal bytes, other memory
        "row1": w[1:],  # same storage, another offset
        "t": w.t(),  # same storage and offset, other strides
        "bytes": w.view(torch.int32),  # same memory, other dtype
        "e1": torch.empty(0),
        "e2": torch.empty(0),
        "m1": torch.empty(4, device="meta"),
        "m2": torch.empty(4, device="meta"),
        "again": w[1:].detach(),  # tied to row1
    }
    assert tied_keys(state, "model") == {"model.head.weight": "model.emb.weight", "model.again": "model.row1"}
