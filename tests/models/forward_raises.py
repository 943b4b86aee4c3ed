"""A module whose forward raises (a shape bug a user could make)."""
import torch
import torch.nn as nn


class ForwardRaises(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        raise RuntimeError("forward is broken on purpose")

    def example_inputs(self, batch):
        return (torch.randn(batch, 3),)
