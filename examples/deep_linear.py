"""A deep linear network: a stack of bias-free matmuls plus one final bias.

Source: Stanford CS336 (Language Modeling from Scratch), lecture on resource
accounting. At the defaults it has 4 * 3 * 3 + 3 = 39 parameters.
"""

import torch
import torch.nn as nn


class DeepLinearModel(nn.Module):
    """``y = x @ W_1 @ ... @ W_L + b`` (no nonlinearity between layers)."""

    def __init__(self, input_dim: int = 3, hidden_dim: int = 3, num_layers: int = 4):
        super().__init__()
        self.input_dim = input_dim
        self.hidden_dim = hidden_dim
        self.num_layers = num_layers
        layers = []
        for i in range(num_layers):
            d_in = input_dim if i == 0 else hidden_dim
            # 1/sqrt(fan_in) initialisation keeps the activations' scale stable.
            layers.append(nn.Parameter(torch.randn(d_in, hidden_dim) / d_in ** 0.5))
        self.layers = nn.ParameterList(layers)
        self.bias = nn.Parameter(torch.zeros(hidden_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.layers:
            x = x @ w
        return x + self.bias

    def example_inputs(self, batch: int):
        return (torch.randn(batch, self.input_dim),)
