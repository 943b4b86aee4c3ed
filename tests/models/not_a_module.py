"""Names that exist but are not nn.Module classes or factories returning one."""
import torch
import torch.nn as nn

GREETING = "hello"


def make_int():
    """A factory that returns an int, not a module."""
    return 42


class NotATorchModule:
    """A plain class: callable, but its instances are not nn.Module."""


class Fine(nn.Module):
    """The one real module in the file (named in the 'modules defined there' hint)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x)

    def example_inputs(self, batch):
        return (torch.randn(batch, 3),)
