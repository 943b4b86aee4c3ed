"""Interpolation, the backward of padding, and pairwise distances: the ``other`` class.

Conventions (guesses in the spirit of pointwise.py, stated once):
- an interpolated output element is a weighted sum of its taps (linear 2, bilinear 4, trilinear
  8, bicubic 16): a multiply and an add per tap, 2·taps per output element; the backward adds
  each gradient element into the same taps, 2·taps per element of the incoming gradient. The
  tap weights, computed once per output row or column, are not counted;
- a padding's backward adds each incoming gradient element into the input position it was
  copied from: the first arrival is a write, so numel(grad_output) − numel(input) adds, exactly;
- a p-norm distance between two M-vectors is M differences, M powers and M adds (the root is
  one op per pair, folded in): 3·M per pair; its backward 3·M per pair too (difference, scale by
  the gradient over the distance, accumulate).
"""

import torch

from fxacct.costs.registry import Flops, numel, register

aten = torch.ops.aten

def _interpolation(taps: int):
    def formula(*args, out_shape, ctx, **kwargs) -> Flops:
        return Flops(other=2 * taps * numel(out_shape))

    return formula


def _interpolation_backward(taps: int):
    def formula(grad_shape, *args, out_shape, ctx, **kwargs) -> Flops:
        return Flops(other=2 * taps * numel(grad_shape))

    return formula


for _op, _taps in (("upsample_linear1d", 2), ("upsample_bilinear2d", 4), ("upsample_trilinear3d", 8),
                   ("upsample_bicubic2d", 16)):
    register(getattr(aten, _op))(_interpolation(_taps))
    register(getattr(aten, _op + "_backward"))(_interpolation_backward(_taps))


@register(aten.reflection_pad1d_backward, aten.reflection_pad2d_backward, aten.reflection_pad3d_backward,
          aten.replication_pad1d_backward, aten.replication_pad2d_backward, aten.replication_pad3d_backward)
def pad_backward(grad_shape, x_shape, padding, *args, out_shape, ctx, **kwargs) -> Flops:
    return Flops(other=numel(grad_shape) - numel(x_shape))


@register(aten._cdist_forward)
def cdist(x1_shape, x2_shape, p, *args, out_shape, ctx, **kwargs) -> Flops:
    # out (..., P, R): one distance per pair over M = x1's last dim
    return Flops(other=3 * numel(out_shape) * x1_shape[-1])


@register(aten._cdist_backward)
def cdist_backward(grad_shape, x1_shape, x2_shape, p, cdist_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    return Flops(other=3 * numel(grad_shape) * x1_shape[-1])
