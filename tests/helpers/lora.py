"""A LoRA fine-tune in miniature, without peft: a frozen base of linear layers, each with a
rank-``r`` adapter (``x @ A.T @ B.T * scale``) that alone is trained."""

from __future__ import annotations

import torch
from torch import nn


class LoRALinear(nn.Module):
    def __init__(self, n: int, rank: int, g: torch.Generator) -> None:
        super().__init__()
        self.base = nn.Linear(n, n)
        with torch.no_grad():
            self.base.weight.copy_(torch.randn(n, n, generator=g) / n**0.5)
            self.base.bias.zero_()
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, n, generator=g) / n**0.5)
        self.lora_B = nn.Parameter(torch.zeros(n, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_A.T @ self.lora_B.T * 2.0


def lora_model(n: int = 256, layers: int = 4, rank: int = 8, seed: int = 0) -> nn.Sequential:
    g = torch.Generator().manual_seed(seed)
    return nn.Sequential(*[LoRALinear(n, rank, g) for _ in range(layers)])


def adapter_optimizer(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, n: int = 256) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, n, generator=g)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def frozen_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
