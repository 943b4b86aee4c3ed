"""Two floating-point outputs of different sizes, for --loss-output; inputs from a module-level
example_inputs(batch) function (the third way of giving inputs)."""
import torch
import torch.nn as nn


class TwoOutputs(nn.Module):
    """(x @ w1, x @ w2) with w1: 3x4 and w2: 3x2; 12 + 6 = 18 parameters."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(3, 4))
        self.w2 = nn.Parameter(torch.randn(3, 2))

    def forward(self, x):
        return x @ self.w1, x @ self.w2


def example_inputs(batch):
    return (torch.randn(batch, 3),)
