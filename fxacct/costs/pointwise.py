"""Elementwise ops, reductions, normalizations, softmax, losses, pooling: the `other` class.

Conventions (guesses, stated once; none of them affects `matmul` or `attention`):
- an op torch tags `pointwise` costs 1 FLOP per output element (transcendentals such as exp or
  tanh are not weighted more; fvcore and flop_counter do not count these ops at all);
- an op torch tags `reduction` costs 1 FLOP per input element (n-1 adds ≈ n);
- composite kernels count the elementwise passes they make, each constant derived at its line.
"""

import torch

from fxacct.costs.registry import Flops, numel, register

aten = torch.ops.aten


def _first(shape_or_tuple):
    """The first output's shape for multi-output ops (out_shape may be a tuple of shapes)."""
    if shape_or_tuple and isinstance(shape_or_tuple[0], (tuple, list)):
        return shape_or_tuple[0]
    return shape_or_tuple


def per_output_element(k: int):
    def formula(*args, out_shape, ctx, **kwargs) -> Flops:
        return Flops(other=k * numel(_first(out_shape)))

    return formula


def per_input_element(k: int):
    def formula(x_shape, *args, out_shape, ctx, **kwargs) -> Flops:
        return Flops(other=k * numel(x_shape))

    return formula


register(torch.Tag.pointwise)(per_output_element(1))
register(torch.Tag.reduction)(per_input_element(1))

# softmax(x) = exp(x - max) / sum(exp(x - max)): max, sub, exp, sum, div = 5 passes
register(aten._softmax, aten._log_softmax, aten._safe_softmax)(per_input_element(5))
# softmax backward: dx = y * (dy - sum(dy * y)): mul, sum, sub, mul = 4 passes
# log_softmax backward: dx = dy - exp(y) * sum(dy): sum, exp, mul, sub = 4 passes
register(aten._softmax_backward_data, aten._log_softmax_backward_data)(per_output_element(4))


@register(aten.native_layer_norm)
def layer_norm(x_shape, normalized_shape, weight, bias, *args, out_shape, ctx, **kwargs) -> Flops:
    # mean (1), x - mean (1), square and sum for var (2), * rstd (1) = 5 passes; affine mul/add +1 each
    n = numel(x_shape)
    return Flops(other=5 * n + (n if weight is not None else 0) + (n if bias is not None else 0))


@register(aten.native_layer_norm_backward)
def layer_norm_backward(grad_shape, x_shape, normalized_shape, mean, rstd, weight, bias,
                        output_mask, *args, out_shape, ctx, **kwargs) -> Flops:
    # dx = rstd · (g - mean(g) - x̂ · mean(g · x̂)) with g = dy·w: about 8 passes over x;
    # dw = sum(dy · x̂) (2 passes), db = sum(dy) (1 pass)
    n = numel(x_shape)
    return Flops(other=(8 * n if output_mask[0] else 0) + (2 * n if output_mask[1] else 0)
                 + (n if output_mask[2] else 0))


@register(aten._fused_rms_norm)
def rms_norm(x_shape, normalized_shape, weight, *args, out_shape, ctx, **kwargs) -> Flops:
    # square, mean, * rstd = 3 passes; weight mul +1
    n = numel(x_shape)
    return Flops(other=3 * n + (n if weight is not None else 0))


@register(aten._fused_rms_norm_backward)
def rms_norm_backward(grad_shape, x_shape, normalized_shape, rstd, weight, output_mask, *args,
                      out_shape, ctx, **kwargs) -> Flops:
    n = numel(x_shape)
    return Flops(other=(6 * n if output_mask[0] else 0) + (2 * n if output_mask[1] else 0))


# batch norm (training): mean, var (3), normalize (2), affine (2) ≈ 7 passes; eval: normalize+affine
register(aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
         aten._native_batch_norm_legit_no_training, aten.native_group_norm)(per_input_element(7))
register(aten.native_batch_norm_backward, aten.native_group_norm_backward)(per_input_element(8))


@register(aten.cudnn_batch_norm, aten.miopen_batch_norm)
def gpu_batch_norm(x_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    return Flops(other=7 * numel(x_shape))


# dropout: a random draw and compare (1) and the scaled mask multiply (1)
register(aten.native_dropout)(per_input_element(2))

# embedding backward scatters one add per gradient element into the table
register(aten.embedding_dense_backward)(per_input_element(1))
register(aten.index_add, aten.scatter_add, aten.index_put, aten.index_put_, aten.scatter_reduce,
         aten._index_put_impl_)(lambda *a, out_shape, ctx, **k: Flops(other=numel(_src_shape(a))))


def _src_shape(args):
    # the updates tensor: last tensor-shaped argument (values / src)
    shapes = [a for a in args if isinstance(a, tuple)]
    return shapes[-1] if shapes else ()


# losses: nll picks one value per target (1 add each); mse: sub, square, sum = 3 per element
register(aten.nll_loss_forward, aten.nll_loss2d_forward)(lambda x, t, *a, out_shape, ctx, **k: Flops(other=numel(t)))
register(aten.nll_loss_backward, aten.nll_loss2d_backward)(lambda g, x, t, *a, out_shape, ctx, **k: Flops(other=numel(t)))
register(aten.mse_loss)(per_input_element(3))
register(aten.mse_loss_backward)(per_output_element(3))
register(aten.binary_cross_entropy_with_logits)(per_input_element(6))


@register(aten.max_pool2d_with_indices, aten.max_pool3d_with_indices, aten.avg_pool2d, aten.avg_pool3d)
def pool(x_shape, kernel_size, *args, out_shape, ctx, **kwargs) -> Flops:
    # one compare (max) or add (avg) per kernel element per output element
    return Flops(other=numel(_first(out_shape)) * numel(kernel_size))


# pooling backward: one scatter/add per grad element (max) or per kernel element (avg)
register(aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward)(per_input_element(1))


@register(aten.avg_pool2d_backward, aten.avg_pool3d_backward)
def avg_pool_backward(grad_shape, x_shape, kernel_size, *args, out_shape, ctx, **kwargs) -> Flops:
    return Flops(other=numel(grad_shape) * numel(kernel_size))


# adaptive average pooling: every input element is added once (+ a divide per output, ignored)
register(aten._adaptive_avg_pool2d, aten._adaptive_avg_pool3d, aten.adaptive_max_pool2d)(per_input_element(1))
register(aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward,
         aten.adaptive_max_pool2d_backward)(per_output_element(1))

# cumulative sums: one add per element
register(aten.cumsum, aten.cumprod, aten.logcumsumexp)(per_input_element(1))


@register("foreach")
def foreach(*args, out_shape, ctx, **kwargs) -> Flops:
    """A _foreach_* op (the multi-tensor path torch.optim takes on CUDA) applies one pointwise op
    to every tensor of its first list: 1 FLOP per element, like its single-tensor twin; the
    copies and fills among them (_foreach_copy_, _foreach_zero_) do no arithmetic."""
    op = ctx.op.overloadpacket.__name__ if ctx.op is not None else ""
    if op.startswith(("_foreach_copy", "_foreach_zero")):
        return Flops()
    first = args[0] if args else ()
    shapes = first if isinstance(first, (list, tuple)) and first and isinstance(first[0], tuple) else ()
    return Flops(other=sum(numel(s) for s in shapes))


@register(aten._embedding_bag, aten._embedding_bag_forward_only)
def embedding_bag(weight_shape, indices_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    # every looked-up row (D values) is added into its bag: one add per gathered element
    # (mean's division, one per bag element of the output, is counted too)
    d = weight_shape[1]
    return Flops(other=numel(indices_shape) * d + numel(_first(out_shape)))


@register(aten._embedding_bag_backward, aten._embedding_bag_dense_backward)
def embedding_bag_backward(grad_shape, indices_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    # each bag's gradient row is scattered back into the table once per index (one add each)
    return Flops(other=numel(indices_shape) * grad_shape[-1])
