"""Small networks shared by the tests of ``pyro_scalable.nn``: plain torch modules and a hand-made LoRA adapter."""

from __future__ import annotations

import torch
from torch import nn


def mlp(widths=(3, 8, 8, 1), batch_norm=False, seed=0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        layers.append(nn.Linear(fan_in, fan_out))
        if fan_out != widths[-1]:
            layers += [nn.BatchNorm1d(fan_out)] if batch_norm else []
            layers.append(nn.Tanh())
    net = nn.Sequential(*layers)
    if batch_norm:  # running statistics that are not the identity, so eval mode is visible
        for module in net.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(0.5, 2)
    return net


class LoRALinear(nn.Module):
    """``base(x) + x Aᵀ Bᵀ``: a frozen linear layer with a rank-r adapter, named as ``peft`` names its adapters."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(0.1 * torch.randn(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + x @ self.lora_A.T @ self.lora_B.T


class TokenClassifier(nn.Module):
    """Mean-pooled embeddings of the unmasked tokens, then a LoRA-adapted linear head: takes a dict batch."""

    def __init__(self, vocabulary=20, width=8, classes=3):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.head = LoRALinear(nn.Linear(width, classes))

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1)
        pooled = (self.embedding(input_ids) * mask).sum(1) / mask.sum(1)
        return self.head(pooled)


def token_data(rows=120, length=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (rows, length), generator=generator)
    mask = torch.ones(rows, length)
    mask[:, 4:] = (torch.rand(rows, 2, generator=generator) > 0.5).float()
    return {"input_ids": ids, "attention_mask": mask}, ids[:, 0] % 3
