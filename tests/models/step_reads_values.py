"""Things fxacct calls that break in ways of their own: an optimizer whose step reads a gradient's
value (.item(), which fake tensors do not have), and checkpoint policies that are no policy."""
import torch
import torch.nn as nn


class ItemSGD(torch.optim.SGD):
    """SGD that skips a step whose gradients sum to zero: a value fake tensors do not have."""

    @torch.no_grad()
    def step(self, closure=None):
        if sum(p.grad.sum() for g in self.param_groups for p in g["params"]).item() == 0:
            return None
        return super().step(closure)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Blocks(nn.Module):
    """Two blocks, for --checkpoint 'blocks.*'."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

    def example_inputs(self, batch):
        return (torch.randn(batch, 4),)


def module_factory():
    """A factory (no arguments) that returns a module, not a policy."""
    return nn.Sequential(nn.Linear(4, 4))


def raising_policy(ctx, op, *args, **kwargs):
    raise KeyError("no rule for this op")
