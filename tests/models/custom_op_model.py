"""A model whose forward calls a torch.library custom op fxacct has no formula for
(tests/test_user_costs.py; tests/models/custom_op_costs.py registers one)."""

import torch
import torch.nn as nn


def _define():
    @torch.library.custom_op("fxacct_test::squared_mm", mutates_args=())
    def squared_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w) ** 2

    @squared_mm.register_fake
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[1])

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, g):  # d(xw)² = 2·(xw)·g, then through the product
        x, w = ctx.saved_tensors
        d = 2 * (x @ w) * g
        return d @ w.t(), x.t() @ d

    squared_mm.register_autograd(backward, setup_context=setup_context)


if not hasattr(torch.ops.fxacct_test, "squared_mm"):  # a process may load this file twice
    _define()


class SquaredMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 24))

    def forward(self, x):
        return torch.ops.fxacct_test.squared_mm(x, self.w)


def example_inputs(batch):
    return (torch.randn(batch, 16),)
