"""A module whose constructor has required arguments and no example_inputs anywhere."""
import torch
import torch.nn as nn


class NeedsArgs(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x):
        return self.lin(x)

    @staticmethod
    def example_inputs(batch):
        return (torch.randn(batch, 4),)
