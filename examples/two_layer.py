"""A two-layer linear network with no bias and no nonlinearity.

Source: Stanford CS336 (Language Modeling from Scratch), lecture on resource
accounting, where the forward and backward FLOPs of ``x @ w1 @ w2`` are
counted by hand (forward = 2 * B * (D*H + H*K) FLOPs; backward = 2x forward).
"""

import math

import torch
import torch.nn as nn


class TwoLayer(nn.Module):
    """``y = x @ w1 @ w2`` with ``w1: (input_dim, hidden_dim)`` and
    ``w2: (hidden_dim, output_dim)``."""

    def __init__(self, input_dim: int = 3, hidden_dim: int = 3, output_dim: int = 2):
        super().__init__()
        self.input_dim = input_dim
        self.hidden_dim = hidden_dim
        self.output_dim = output_dim
        # Scale by 1/sqrt(fan_in) so that activations keep roughly unit variance.
        self.w1 = nn.Parameter(torch.randn(input_dim, hidden_dim) / math.sqrt(input_dim))
        self.w2 = nn.Parameter(torch.randn(hidden_dim, output_dim) / math.sqrt(hidden_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, D) @ (D, H) -> (B, H); (B, H) @ (H, K) -> (B, K)
        return x @ self.w1 @ self.w2

    def example_inputs(self, batch: int):
        return (torch.randn(batch, self.input_dim),)
