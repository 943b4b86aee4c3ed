"""Data-dependent control flow: the branch depends on tensor values, which fake tensors do not have."""
import torch
import torch.nn as nn


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            return y * 2
        return y

    def example_inputs(self, batch):
        return (torch.randn(batch, 3),)
