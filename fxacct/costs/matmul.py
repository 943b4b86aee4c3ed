"""Matrix products and convolutions: the `matmul` class, 2 FLOPs per multiply-add.

A fused bias add (addmm, baddbmm, convolution with bias) is 1 FLOP per output element in `other`,
so `matmul` stays 2·m·n·p and equals torch.utils.flop_counter's figure.
"""

import torch

from fxacct.costs.registry import Flops, argument, numel, register
from fxacct.units import FLOPS_PER_FMA

aten = torch.ops.aten


def mm_flops(a_shape, b_shape) -> int:
    # (m, k) @ (k, n): m·n outputs, k multiply-adds each
    m, k = a_shape
    k2, n = b_shape
    assert k == k2, (a_shape, b_shape)
    return FLOPS_PER_FMA * m * k * n


def bmm_flops(a_shape, b_shape) -> int:
    # (b, m, k) @ (b, k, n)
    b, m, k = a_shape
    b2, k2, n = b_shape
    assert b == b2 and k == k2, (a_shape, b_shape)
    return FLOPS_PER_FMA * b * m * k * n


@register(aten.mm)
def mm(a_shape, b_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    return Flops(matmul=mm_flops(a_shape, b_shape))


@register(aten.addmm)
def addmm(bias_shape, a_shape, b_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    # bias (broadcast to m×n) + a @ b: the product, then one add per output element
    return Flops(matmul=mm_flops(a_shape, b_shape), other=numel(out_shape))


@register(aten.bmm)
def bmm(a_shape, b_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    return Flops(matmul=bmm_flops(a_shape, b_shape))


@register(aten.baddbmm)
def baddbmm(bias_shape, a_shape, b_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    return Flops(matmul=bmm_flops(a_shape, b_shape), other=numel(out_shape))


# The vector forms (torch.matmul of a matrix and a vector lowers to mv; x @ y of two vectors to
# dot) and the accumulating ones, as the products they are; torch.utils.flop_counter counts none
# of them (its registry: mm, addmm, bmm, baddbmm, convolutions, _scaled_mm, attention).
@register(aten.mv)
def mv(a_shape, v_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    # (m, k) @ (k,): an mm with n = 1
    return Flops(matmul=mm_flops(a_shape, (v_shape[0], 1)))


@register(aten.dot, aten.vdot)
def dot(a_shape, b_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    # (n,) · (n,): n multiply-adds (vdot conjugates the first, which costs no FLOP)
    return Flops(matmul=mm_flops((1, a_shape[0]), (b_shape[0], 1)))


@register(aten.addmv)
def addmv(bias_shape, a_shape, v_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    return Flops(matmul=mm_flops(a_shape, (v_shape[0], 1)), other=numel(out_shape))


@register(aten.addr)
def addr(bias_shape, u_shape, v_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    # bias + u ⊗ v: the outer product as an mm with k = 1, then the add, as addmm counts it
    return Flops(matmul=mm_flops((u_shape[0], 1), (1, v_shape[0])), other=numel(out_shape))


@register(aten.addbmm)
def addbmm(bias_shape, a_shape, b_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    # bias + Σ_b a_b @ b_b: the batch is contracted with k, so every multiply-add is in the bmm
    return Flops(matmul=bmm_flops(a_shape, b_shape), other=numel(out_shape))


def conv_flops(x_shape, w_shape, out_shape, transposed: bool) -> int:
    """x (N, C_in, *spatial), w (C_out, C_in/groups, *kernel) [transposed: (C_in, C_out/groups, *k)].

    Every output element of a regular convolution takes C_in/groups · prod(kernel) multiply-adds,
    so FLOPs = 2 · N · prod(out spatial) · prod(w). A transposed convolution scatters each *input*
    element over the kernel: 2 · N · prod(in spatial) · prod(w). (Same as torch.utils.flop_counter.)"""
    batch = x_shape[0]
    spatial = out_shape[2:] if not transposed else x_shape[2:]
    return FLOPS_PER_FMA * batch * numel(spatial) * numel(w_shape)


@register(aten.convolution, aten._convolution)
def convolution(x_shape, w_shape, bias_shape, stride, padding, dilation, transposed, *args,
                out_shape, ctx, **kwargs) -> Flops:
    bias = numel(out_shape) if bias_shape is not None else 0
    return Flops(matmul=conv_flops(x_shape, w_shape, out_shape, transposed), other=bias)


@register(aten.convolution_backward)
def convolution_backward(grad_out_shape, x_shape, w_shape, bias_sizes, stride, padding, dilation,
                         transposed, output_padding, groups, output_mask, *, out_shape, ctx,
                         **kwargs) -> Flops:
    """Only the gradients in output_mask are computed (the backward asks for what it needs):
    grad_input is a convolution of grad_out with w, transposed-ness flipped; grad_weight pairs
    every (input, kernel tap, output) triple the forward did, once each: as many multiply-adds as
    the forward, groups included (a channel-swapped formulation as in torch.utils.flop_counter
    overcounts grouped convolutions by the group count); grad_bias a sum over grad_out."""
    flops = 0
    if output_mask[0]:
        flops += conv_flops(grad_out_shape, w_shape, x_shape, not transposed)
    if output_mask[1]:
        flops += conv_flops(x_shape, w_shape, grad_out_shape, transposed)
    other = numel(grad_out_shape) if output_mask[2] else 0
    return Flops(matmul=flops, other=other)


@register(aten._scaled_mm)
def scaled_mm(a_shape, b_shape, scale_a_shape, scale_b_shape, bias_shape=None, *args, out_shape, ctx,
              **kwargs) -> Flops:
    """fp8 matmul (torchao-style fp8 training runs its forward and both backward products as
    _scaled_mm): matmul 2·m·k·n as torch.utils.flop_counter counts it; a fused bias is one add
    per output element in `other`, as for addmm (the scaling is folded into the product)."""
    bias_shape = kwargs.get("bias", bias_shape)
    return Flops(matmul=mm_flops(a_shape, b_shape), other=numel(out_shape) if bias_shape is not None else 0)


def grouped_mm_flops(a_shape, b_shape, out_shape) -> int:
    """aten._grouped_mm (MoE experts: one product per group, the groups cut by ``offs``), by the
    four layouts of its meta kernel (torch/_meta_registrations.py, _create_grouped_mm_output_tensor):

    - 2d × 3d: a (M, K) rows cut into G groups, b (G, K, N) → (M, N): every row one K-long product
      per output column, 2·M·N·K;
    - 3d × 2d: a (G, M, K), b (K, N) columns cut into G groups → (M, N): 2·M·N·K;
    - 3d × 3d: a batched product (G, M, K) @ (G, K, N) → (G, M, N): 2·G·M·N·K;
    - 2d × 2d: a (M, K) and b (K, N), K cut into G groups → (G, M, N): group g contracts K_g,
      Σ 2·M·N·K_g = 2·M·N·K.

    Rows (columns) past ``offs[-1]`` are not computed by the kernel; their count is a value, not a
    shape, so every row is counted (exact when the groups cover the tensor, as MoE dispatch does)."""
    k = a_shape[-1]
    out = numel(out_shape)
    if len(a_shape) == 2 and len(b_shape) == 2:
        out //= out_shape[0]  # the G copies of (M, N) share one contraction over K
    return FLOPS_PER_FMA * out * k


@register(aten._grouped_mm, aten._scaled_grouped_mm)
def grouped_mm(a_shape, b_shape, *args, out_shape, ctx, **kwargs) -> Flops:
    # a fused bias (an optional argument of both) adds 1 per output element, as for addmm
    bias = argument(ctx.op, (a_shape, b_shape, *args), kwargs, "bias") if ctx.op is not None else None
    return Flops(matmul=grouped_mm_flops(a_shape, b_shape, out_shape), other=numel(out_shape) if bias is not None else 0)
