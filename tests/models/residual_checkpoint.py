"""Residual MLP blocks (x + block(x)) in four arrangements a user writes: plain; each block
called through torch.utils.checkpoint from the parent's loop (non-reentrant and reentrant); and
each block checkpointing its own inner MLP. Three blocks, so that block replay has a run to replay."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))


class Residual(nn.Module):
    def __init__(self, n_blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList([mlp() for _ in range(n_blocks)])

    def forward(self, x):
        for block in self.blocks:
            x = x + self.call(block, x)
        return x

    def call(self, block, x):
        return block(x)

    @staticmethod
    def example_inputs(batch: int):
        return (torch.randn(batch, 32, 128),)


class CheckpointedCalls(Residual):
    def call(self, block, x):
        return checkpoint(block, x, use_reentrant=False)


class ReentrantCalls(Residual):
    def call(self, block, x):
        return checkpoint(block, x, use_reentrant=True)


class InnerCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = mlp()

    def forward(self, x):
        return x + checkpoint(self.f, x, use_reentrant=False)


class CheckpointInside(Residual):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([InnerCheckpoint() for _ in range(3)])
