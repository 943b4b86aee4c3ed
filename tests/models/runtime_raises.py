"""A module that traces on fake tensors but whose forward raises on real ones: the real run
(--runtime) fails in the user's file, a model error naming its line."""
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake


class RuntimeRaises(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        if not is_fake(x):
            raise ValueError("real tensors are refused on purpose")
        return self.lin(x)

    def example_inputs(self, batch):
        return (torch.randn(batch, 3),)
