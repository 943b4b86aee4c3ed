"""A constructor that fails a bare `assert` (no message), as nanoGPT's `assert n_embd % n_head == 0`
does: the exception text is empty, so only the source line tells the user what went wrong."""
import torch
import torch.nn as nn


class BareAssert(nn.Module):
    def __init__(self, n_embd: int = 32, n_head: int = 4):
        super().__init__()
        assert n_embd % n_head == 0
        self.lin = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        return self.lin(x)

    def example_inputs(self, batch):
        return (torch.randn(batch, self.lin.in_features),)
