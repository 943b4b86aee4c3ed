"""A residual MLP: pre-LayerNorm feed-forward blocks, as in a Transformer
without attention.

Each block computes ``x = x + fc2(gelu(fc1(ln(x))))`` (the Transformer FFN
sublayer of Vaswani et al., 2017, "Attention Is All You Need", with the
pre-norm placement of GPT-2, Radford et al., 2019). The cost is dominated by
the two matmuls per block: about 2 * 2 * B * d_model * d_hidden FLOPs forward.
"""

import torch
import torch.nn as nn


class MLPBlock(nn.Module):
    """One pre-norm residual feed-forward block."""

    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class MLP(nn.Module):
    """``n_blocks`` residual MLP blocks followed by a final LayerNorm.

    Input and output are ``(batch, d_model)`` float tensors.
    """

    def __init__(self, d_model: int = 1024, d_hidden: int = 4096, n_blocks: int = 4):
        super().__init__()
        self.d_model = d_model
        self.d_hidden = d_hidden
        self.n_blocks = n_blocks
        self.blocks = nn.ModuleList([MLPBlock(d_model, d_hidden) for _ in range(n_blocks)])
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def example_inputs(self, batch: int):
        return (torch.randn(batch, self.d_model),)
