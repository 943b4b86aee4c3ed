"""Losses, dropout and the embedding gradient (the `other` class), costed as the composite each
kernel replaces: torch's own decomposition (torch/_decomp/decompositions.py, lowered to core ATen)
counted under fxacct's family rules (1 FLOP per output element of a pointwise op, 1 per input
element of a reduction; integer and boolean index bookkeeping, views and copies are not FLOPs).
tests/test_formulas.py re-derives each formula from the decomposition.

reduction: 0 = none, 1 = mean, 2 = sum (at::Reduction).
"""

import torch

from fxacct.costs.registry import Flops, numel, register

aten = torch.ops.aten

NONE, MEAN = 0, 1  # at::Reduction::None, ::Mean


@register(aten.nll_loss_forward, aten.nll_loss2d_forward)
def nll_loss(x_shape, target_shape, weight, reduction, *args, out_shape, ctx, **kwargs) -> Flops:
    t = numel(target_shape)
    flops = 2 * t  # -x[target] (t), where(target == ignore_index, 0, ·) (t)
    if weight is not None:
        flops += numel(x_shape)  # x · weight, broadcast over the input
    if reduction != NONE:
        flops += t  # sum of the picked values
        flops += 2 * t if weight is not None else 0  # masked weights and their sum
        flops += 1 if reduction == MEAN else 0  # / total weight
    return Flops(other=flops)


@register(aten.nll_loss_backward, aten.nll_loss2d_backward)
def nll_loss_backward(grad_shape, x_shape, target_shape, weight, reduction, *args, out_shape, ctx,
                      **kwargs) -> Flops:
    n = numel(x_shape)
    if weight is None:
        flops = numel(target_shape) + n  # where(ignored, 0, grad) (t), one-hot · grad (n)
    else:
        # weight · grad per class (C) or broadcast over the input (n, no reduction);
        # where(ignored) and one-hot · that (n each)
        flops = 2 * n + (numel(weight) if reduction != NONE else n)
    return Flops(other=flops + (1 if reduction == MEAN else 0))  # grad / total weight


@register(aten.mse_loss)
def mse_loss(x_shape, target_shape, reduction=MEAN, *args, out_shape, ctx, **kwargs) -> Flops:
    n = numel(x_shape)
    return Flops(other=2 * n + (n if reduction != NONE else 0))  # x - y, ², mean/sum


@register(aten.mse_loss_backward)
def mse_loss_backward(grad_shape, x_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    return Flops(other=3 * numel(x_shape))  # (x - y) · (2/N or 2) · grad: 3 passes


@register(aten.smooth_l1_loss, aten.huber_loss)
def smooth_l1_loss(x_shape, target_shape, reduction=MEAN, *args, out_shape, ctx, **kwargs) -> Flops:
    # d = x − y, |d|, |d| < β, then 0.5·d²/β or |d| − 0.5·β (counted as 2): 5 passes, and the mean/sum
    n = numel(x_shape)
    return Flops(other=5 * n + (n if reduction != NONE else 0))


@register(aten.smooth_l1_loss_backward, aten.huber_loss_backward)
def smooth_l1_loss_backward(grad_shape, x_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    return Flops(other=4 * numel(x_shape))  # x − y, |d| < β, d/β or sign(d), · grad (1/N folded in)


@register(aten.binary_cross_entropy_with_logits)
def bce_with_logits(x_shape, target_shape, weight=None, pos_weight=None, reduction=MEAN, *args,
                    out_shape, ctx, **kwargs) -> Flops:
    n = numel(x_shape)
    # (1 - y)·x, min(0, x), |x|, -|x|, exp, log1p, two subs and the stable log-sigmoid sum: 9n
    flops = 9 * n
    if pos_weight is not None:
        # pos_weight - 1 (its own size); ·y, + 1, · log-sigmoid (n each)
        flops += numel(pos_weight) + 3 * n
    flops += n if weight is not None else 0  # · weight
    return Flops(other=flops + (n if reduction != NONE else 0))  # mean/sum


@register(aten.native_dropout)
def dropout(x_shape, p, train, *args, out_shape, ctx, **kwargs) -> Flops:
    if not train or p == 0 or p == 1:  # identity, or all zeros: no arithmetic
        return Flops()
    # rand_like > p (n), mask · x (n), · 1/(1-p) (n); drawing the random numbers is creation
    return Flops(other=3 * numel(x_shape))


@register(aten.embedding_dense_backward)
def embedding_backward(grad_shape, indices_shape, num_weights, padding_idx, scale_grad_by_freq,
                       *args, out_shape, ctx, **kwargs) -> Flops:
    n = numel(grad_shape)
    flops = 2 * n  # where(index == padding_idx, 0, grad), index_put accumulate (n each)
    if scale_grad_by_freq:
        # count each index (an accumulate per index), grad / count (n)
        flops += numel(indices_shape) + n
    return Flops(other=flops)
