"""Five blocks of one class, the same parameters and attributes, whose forward takes another path
on every other call (a class-level counter): only tracing two of them tells them apart. Inputs from
a module-level example_inputs(batch)."""
import torch
import torch.nn as nn


class Alternating(nn.Module):
    calls = 0  # forward calls so far, over every block: odd calls take relu, even ones double

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        Alternating.calls += 1
        y = self.lin(x)
        return torch.relu(y) if Alternating.calls % 2 else y * 2


class Stack(nn.Module):
    def __init__(self, n_blocks: int = 5):
        super().__init__()
        Alternating.calls = 0  # each model built counts its own calls
        self.blocks = nn.ModuleList(Alternating() for _ in range(n_blocks))
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def example_inputs(batch):
    return (torch.randn(batch, 16),)
