"""A module whose constructor raises with user-supplied arguments."""
import torch
import torch.nn as nn


class CtorRaises(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        if width % 2:
            raise ValueError(f"width must be even, got {width}")
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return self.lin(x)

    def example_inputs(self, batch):
        return (torch.randn(batch, self.lin.in_features),)
