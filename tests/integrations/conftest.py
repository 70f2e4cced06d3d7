"""Trainers change process-wide torch settings (Lightning's ``Trainer(deterministic=True)`` turns
on ``torch.use_deterministic_algorithms`` and leaves it on): each test here gives them back, so
that tests elsewhere in the same process run under the defaults."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _torch_global_settings():
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
