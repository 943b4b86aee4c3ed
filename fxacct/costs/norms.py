"""Softmax and normalizations (the `other` class), each costed as the composite it replaces.

Every count is the decomposition torch itself gives (torch/_decomp/decompositions.py, lowered to
core ATen) under fxacct's own family rules: 1 FLOP per output element of a pointwise op, 1 per
input element of a reduction (var_mean included), nothing for views and copies. The term comments
name the ops; tests/test_formulas.py re-derives every formula from torch's decomposition.
n = elements of the input, rows = elements of one statistic (n / normalized size).
"""

import torch

from fxacct.costs.registry import Flops, numel, register

aten = torch.ops.aten


def _rows(x_shape, dim) -> int:
    return numel(x_shape) // int(x_shape[dim]) if x_shape else 1


@register(aten._softmax)
def softmax(x_shape, dim, *args, out_shape, ctx, **kwargs) -> Flops:
    # amax, x - max, exp, sum, / sum: 5 passes over x (n)
    return Flops(other=5 * numel(x_shape))


@register(aten._log_softmax)
def log_softmax(x_shape, dim, *args, out_shape, ctx, **kwargs) -> Flops:
    # amax, x - max, exp, sum (n each), log of the sum (rows), shifted - log (n)
    return Flops(other=5 * numel(x_shape) + _rows(x_shape, dim))


@register(aten._safe_softmax)
def safe_softmax(x_shape, dim, *args, out_shape, ctx, **kwargs) -> Flops:
    # _softmax (5n), x == -inf (n), where(row fully masked, 0, softmax) (n); the boolean
    # logical_not / any over the mask are not floating-point work
    return Flops(other=7 * numel(x_shape))


# dx = y·dy - y·sum(y·dy): mul, sum, mul, sub (n each)
# log_softmax: dx = dy - exp(y)·sum(dy): exp, sum, mul, sub (n each)
@register(aten._softmax_backward_data, aten._log_softmax_backward_data)
def softmax_backward(grad_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    return Flops(other=4 * numel(grad_shape))


def _affine(n: int, weight, bias) -> int:
    return (n if weight is not None else 0) + (n if bias is not None else 0)  # · w, + b (n each)


@register(aten.native_layer_norm)
def layer_norm(x_shape, normalized_shape, weight, bias, *args, out_shape, ctx, **kwargs) -> Flops:
    n = numel(x_shape)
    rows = n // numel(normalized_shape)
    # var_mean (n), var + eps and rsqrt (rows each), x - mean and · rstd (n each)
    return Flops(other=3 * n + 2 * rows + _affine(n, weight, bias))


@register(aten.native_layer_norm_backward)
def layer_norm_backward(grad_shape, x_shape, normalized_shape, mean, rstd, weight, bias,
                        output_mask, *args, out_shape, ctx, **kwargs) -> Flops:
    n = numel(x_shape)
    rows = n // numel(normalized_shape)
    need_x, need_w = output_mask[0], output_mask[1] and weight is not None
    flops = 2 * n if need_x or need_w else 0  # x̂ = (x - mean) · rstd
    if need_x:
        # g = dy·w (n, with w); g·N, sum(g), g·x̂, sum(g·x̂), x̂·sum, two subs (n each);
        # rstd / N (rows), · that (n)
        flops += 8 * n + rows + (n if weight is not None else 0)
    if need_w:
        flops += 2 * n  # dw = sum(dy · x̂)
    if output_mask[2] and bias is not None:
        flops += n  # db = sum(dy)
    return Flops(other=flops)


@register(aten._fused_rms_norm)
def rms_norm(x_shape, normalized_shape, weight, *args, out_shape, ctx, **kwargs) -> Flops:
    n = numel(x_shape)
    rows = n // numel(normalized_shape)
    # x², mean (n each), + eps, rsqrt (rows each), x · rstd (n), · w (n)
    return Flops(other=3 * n + 2 * rows + (n if weight is not None else 0))


@register(aten._fused_rms_norm_backward)
def rms_norm_backward(grad_shape, x_shape, normalized_shape, rstd, weight, output_mask, *args,
                      out_shape, ctx, **kwargs) -> Flops:
    n = numel(x_shape)
    need_x, need_w = output_mask[0], output_mask[1] and weight is not None
    flops = n if need_x or need_w else 0  # x̂ = x · rstd
    if need_x:
        # g = dy·w (n, with w); g·x̂, sum, / N, · x̂... : 6 more passes over x
        flops += 6 * n + (n if weight is not None else 0)
    if need_w:
        flops += 2 * n  # dw = sum(dy · x̂)
    return Flops(other=flops)


def batch_norm_flops(x_shape, weight, bias, training, running_stats: bool) -> int:
    """x (N, C, *spatial): statistics per channel c over n / C elements."""
    n, c = numel(x_shape), int(x_shape[1])
    if training:
        stats = n + 2 * c  # var_mean (n), var + eps and rsqrt (C each)
        # running_mean·(1-m) + m·mean (3C); running_var·(1-m) + m·var·n/(n-1) (4C)
        stats += 7 * c if running_stats else 0
    else:
        # invstd = rsqrt(running_var + eps): add, rsqrt (C each), as in training and the backward.
        # torch's decomposition wrote 1 / sqrt(...) up to 2.14 (sqrt, reciprocal and a · 1 from the
        # scalar division: 2C more, none of it work a kernel does); 2.15 writes rsqrt
        stats = 2 * c
    return stats + 2 * n + _affine(n, weight, bias)  # (x - mean) · invstd (n each), affine


@register(aten.native_batch_norm, aten._native_batch_norm_legit.default,
          aten._native_batch_norm_legit_functional, aten.cudnn_batch_norm, aten.miopen_batch_norm)
def batch_norm(x_shape, weight, bias, running_mean, running_var, training, *args, out_shape, ctx,
               **kwargs) -> Flops:
    return Flops(other=batch_norm_flops(x_shape, weight, bias, training, running_mean is not None))


@register(aten._native_batch_norm_legit.no_stats)
def batch_norm_no_stats(x_shape, weight, bias, training, *args, out_shape, ctx, **kwargs) -> Flops:
    return Flops(other=batch_norm_flops(x_shape, weight, bias, training, False))


@register(aten._native_batch_norm_legit_no_training)
def batch_norm_eval(x_shape, weight, bias, *args, out_shape, ctx, **kwargs) -> Flops:
    return Flops(other=batch_norm_flops(x_shape, weight, bias, False, True))


@register(aten.native_batch_norm_backward)
def batch_norm_backward(grad_shape, x_shape, weight, running_mean, running_var, save_mean,
                        save_invstd, train, eps, output_mask, *args, out_shape, ctx,
                        **kwargs) -> Flops:
    n, c = numel(x_shape), int(x_shape[1])
    need_x, need_w, need_b = output_mask
    # sum(dy) and dot = sum(dy · (x - mean)) (3n) feed the input gradient only in training
    flops = n if need_b or (need_x and train) else 0
    flops += 3 * n if need_w or (need_x and train) else 0
    flops += 2 * c if not train and (need_x or need_w) else 0  # rsqrt(running_var + eps)
    if need_x:
        # train: sum(dy)/N, dot/N · invstd², invstd·w (5C); dy - (x - mean)·proj - mean_dy,
        # · scale (5n). Eval: dy · (invstd·w) (C + n)
        flops += 5 * c + 5 * n if train else c + n
    if need_w:
        flops += c  # dw = dot · invstd
    return Flops(other=flops)


@register(aten.native_group_norm)
def group_norm(x_shape, weight, bias, n_batch, channels, hxw, group, *args, out_shape, ctx,
               **kwargs) -> Flops:
    n = numel(x_shape)
    stats = n_batch * group  # one mean and rstd per (sample, group)
    flops = n + 2 * stats  # var_mean (n), var + eps and rsqrt
    if weight is not None:
        # scale = rstd·w, shift = -mean·scale (+ b) per (sample, channel); x·scale + shift (2n)
        nc = n_batch * channels
        flops += stats + 2 * nc + (nc if bias is not None else 0) + 2 * n
    else:
        flops += 2 * n + (n if bias is not None else 0)  # (x - mean)·rstd, + b
    return Flops(other=flops)


@register(aten.native_group_norm_backward)
def group_norm_backward(grad_shape, x_shape, mean, rstd, weight, n_batch, channels, hxw, group,
                        output_mask, *args, out_shape, ctx, **kwargs) -> Flops:
    n = numel(x_shape)
    nc, stats = n_batch * channels, n_batch * group
    need_x, need_w, need_b = output_mask
    flops = 2 * n if need_x or need_w else 0  # ds = sum(dy · x) per (sample, channel)
    flops += n  # db = sum(dy) per (sample, channel): every output needs it
    if need_x:
        # ds·w, db·w and their group sums, rstd·w (5 NC; 3 NC without w); c2, c3 (11 per group);
        # dy·c1 + x·c2 + c3 (4n)
        flops += (5 * nc if weight is not None else 3 * nc) + 11 * stats + 4 * n
    if need_w:
        flops += 4 * nc  # dw = sum over samples of (ds - db·mean)·rstd
    if need_b:
        flops += nc  # dbias = sum over samples of db
    return Flops(other=flops)
