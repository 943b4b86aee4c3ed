"""Elementwise ops, reductions, scatters, pooling, scans and multi-tensor ops: the `other` class
(softmax and norms are in norms.py, losses and dropout in losses.py).

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
# Python's `a | b`, `a & b` on tensors dispatch to these overloads, which torch leaves untagged
# (bitwise_or/and carry the pointwise tag): 1 FLOP per output element, as bitwise_or
register(aten.__or__.Tensor, aten.__or__.Scalar, aten.__and__.Tensor, aten.__and__.Scalar,
         aten.__ior__.Tensor, aten.__ior__.Scalar, aten.__iand__.Tensor, aten.__iand__.Scalar,
         aten.__ixor__.Tensor, aten.__ixor__.Scalar)(per_output_element(1))
# untagged too: floor_divide is one division per output (as div); histc one bin lookup per input
register(aten.floor_divide.default, aten.floor_divide.Scalar, aten.floor_divide_.Tensor,
         aten.floor_divide_.Scalar)(per_output_element(1))
register(aten.histc)(per_input_element(1))
# activations torch leaves untagged where their siblings carry the pointwise tag (hardsigmoid,
# elu, hardtanh, leaky_relu, softplus, mish; gelu_backward, silu_backward, threshold_backward):
# 1 FLOP per output element, as those siblings; masked_fill_ as masked_fill
register(aten.hardswish, aten.hardswish_, aten.hardswish_backward, aten.hardsigmoid_backward, aten.mish_,
         aten.mish_backward, aten.elu_backward, aten.hardtanh_backward, aten.leaky_relu_backward,
         aten.log_sigmoid_forward, aten.log_sigmoid_backward, aten.softplus_backward, aten.softshrink_backward,
         aten.hardshrink_backward, aten._prelu_kernel, aten.masked_fill_)(per_output_element(1))
# PReLU's backward: the input's gradient where(x > 0, g, w·g) and the weight's x·g where x ≤ 0,
# 2 passes each over the input (the weight's sum over the broadcast dims is autograd's own op)
register(aten._prelu_kernel_backward)(lambda g, x, w, *a, out_shape, ctx, **k: Flops(other=4 * numel(x)))
# scatter with a reduction: one add (or multiply) per source element, as scatter_reduce
register(aten.scatter.reduce, aten.scatter.value_reduce, aten.scatter_.reduce, aten.scatter_.value_reduce)(
    lambda x_shape, dim, index_shape, *a, out_shape, ctx, **k: Flops(other=numel(index_shape)))

register(aten.index_add, aten.scatter_add, aten.scatter_reduce)(
    lambda *a, out_shape, ctx, **k: Flops(other=numel(_src_shape(a))))


def _src_shape(args):
    # the updates tensor: last tensor-shaped argument (source / src)
    shapes = [a for a in args if isinstance(a, tuple)]
    return shapes[-1] if shapes else ()


@register(aten.index_put, aten.index_put_, aten._index_put_impl_)
def index_put(x_shape, indices, values_shape, accumulate=False, *args, out_shape, ctx,
              **kwargs) -> Flops:
    # accumulate=True adds each value into its slot (1 per value); otherwise a scatter copy
    return Flops(other=numel(values_shape) if accumulate else 0)


@register(aten._unsafe_masked_index_put_accumulate)
def masked_index_put_accumulate(x_shape, mask_shape, indices, values_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    # inductor's decomposition of embedding's backward (torch/_decomp: index_put_ with accumulate
    # where the mask holds): one add per value, as index_put's accumulate
    return Flops(other=numel(values_shape))


def _window(kernel_size, dims: int) -> int:
    # kernel_size is int[dims]; a single value stands for every spatial dimension
    k = [int(v) for v in kernel_size]
    return k[0] ** dims if len(k) == 1 else numel(k)


def pool(dims: int):
    """Pooling convention: one compare (max) or add (avg) per window element per output element
    (out · window; an average's single divide per output is folded in, as a reduction's is). The
    max-pool decomposition's only floating-point work is exactly that amax over the windows."""

    def formula(x_shape, kernel_size, *args, out_shape, ctx, **kwargs) -> Flops:
        return Flops(other=numel(_first(out_shape)) * _window(kernel_size, dims))

    return formula


register(aten.max_pool2d_with_indices, aten.avg_pool2d)(pool(2))
register(aten.max_pool3d_with_indices, aten.avg_pool3d)(pool(3))

# max-pool backward: each gradient element is added once into its argmax position (grad numel)
register(aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward)(per_input_element(1))


def avg_pool_backward(dims: int):
    """Average-pool backward: every gradient element is spread over its window (grad · window)."""

    def formula(grad_shape, x_shape, kernel_size, *args, out_shape, ctx, **kwargs) -> Flops:
        return Flops(other=numel(grad_shape) * _window(kernel_size, dims))

    return formula


register(aten.avg_pool2d_backward)(avg_pool_backward(2))
register(aten.avg_pool3d_backward)(avg_pool_backward(3))


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
