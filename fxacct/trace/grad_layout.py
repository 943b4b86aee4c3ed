"""A replayed block's parameter gradients as the traced block's were: under tensor parallelism
each is a DTensor (its mesh, placements, global shape and stride); the replay computes the local
shard, and wraps it in the layout its template's probe recorded (fxacct.trace.replay_train)."""

from __future__ import annotations

from fxacct.trace import torch_private as tp
from fxacct.trace.records import TAG


def layout_of(grad):
    """A DTensor gradient's (mesh, placements, shape, stride); None for a plain tensor or None."""
    if grad is None or tp.local(grad) is grad:
        return None
    return grad.device_mesh, grad.placements, tuple(grad.shape), tuple(grad.stride())


def as_layout(grad, layout):
    """``grad`` (a local tensor) as a DTensor of the probe's gradient ``layout`` (None: as it is),
    its local shard tagged as ``grad`` is."""
    if grad is None or layout is None:
        return grad
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = layout
    out = DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)
    setattr(tp.local(out), TAG, getattr(grad, TAG))
    return out
