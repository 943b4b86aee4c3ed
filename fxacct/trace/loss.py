"""The loss fxacct differentiates (DESIGN.md): one definition for the trace and for real runs."""

from __future__ import annotations

import torch

from fxacct.errors import ModelError, UsageError
from fxacct.trace import torch_private as tp


def training_loss(output, loss_output: int | None = None) -> torch.Tensor:
    """DESIGN.md: the sum over every floating-point output tensor (pytree order) of t.float().sum(),
    or only the output at index ``loss_output`` of that list."""
    leaves = [t for t in tp.tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if loss_output is not None:
        if not 0 <= loss_output < len(leaves):
            raise UsageError(
                f"--loss-output {loss_output} is out of range: the model returns {len(leaves)} "
                f"floating-point tensor(s); pick an index from 0 to {len(leaves) - 1}"
            )
        leaves = [leaves[loss_output]]
    if not leaves:
        raise ModelError("the model returned no floating-point tensor to build a loss from; "
                         "return the logits or the loss from forward")
    loss = leaves[0].float().sum()
    for t in leaves[1:]:
        loss = loss + t.float().sum()
    return loss
