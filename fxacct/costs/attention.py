"""Fused attention kernels, all costed as the math path they replace (the `attention` class).

Forward, per (batch, head): S = Q Kᵀ is 2·Tq·Tk·d, O = P V is 2·Tq·Tk·dv (softmax not counted
here, as in torch.utils.flop_counter). Backward without recompute (model FLOPs): dV = Pᵀ dO
(2·Tq·Tk·dv), dP = dO Vᵀ (2·Tq·Tk·dv), dQ = dS K (2·Tq·Tk·d), dK = dSᵀ Q (2·Tq·Tk·d); so 2× the
forward when q, k and v all need a gradient, and only the terms a required gradient depends on
otherwise. Causal masking is not subtracted (DESIGN.md default); `--causal-attention halved`
halves every causal kernel's count.
"""

import torch

from fxacct.costs.registry import CostContext, Flops, argument, register
from fxacct.trace.torch_private import schema_arguments
from fxacct.units import FLOPS_PER_FMA

aten = torch.ops.aten


def _dims_bhtd(q_shape, k_shape, v_shape):
    # (B, H, T, d); grouped-query attention: k, v may have fewer heads, the work follows q's heads
    *bh, tq, d = q_shape
    tk, dv = k_shape[-2], v_shape[-1]
    b_h = 1
    for s in bh:
        b_h *= int(s)
    return b_h, tq, tk, d, dv


def _dims_bthd(q_shape, k_shape, v_shape):
    # (B, T, H, d) layout of _flash_attention_forward / _efficient_attention_forward
    b, tq, h, d = q_shape
    return b * h, tq, k_shape[1], d, v_shape[-1]


def attention_forward_flops(b_h, tq, tk, d, dv) -> int:
    return FLOPS_PER_FMA * b_h * tq * tk * (d + dv)  # Q Kᵀ + P V


def attention_backward_flops(b_h, tq, tk, d, dv, grad_mask) -> int:
    need_q, need_k, need_v = grad_mask[:3] if grad_mask is not None else (True, True, True)
    per = FLOPS_PER_FMA * b_h * tq * tk
    flops = 0
    if need_v:
        flops += per * dv  # dV = Pᵀ dO
    if need_q or need_k:
        flops += per * dv  # dP = dO Vᵀ (then dS = softmax backward, in no class here)
    if need_q:
        flops += per * d  # dQ = dS K
    if need_k:
        flops += per * d  # dK = dSᵀ Q
    return flops


def _causal_scale(flops: int, is_causal: bool, ctx: CostContext) -> int:
    return flops // 2 if is_causal and ctx.causal_attention == "halved" else flops


def _is_causal(ctx: CostContext, args, kwargs) -> bool:
    """`is_causal` by name; the xformers-style kernels say it as custom_mask_type (1 = causal from
    the top left, 2 = from the bottom right; 0 = none). args: every positional argument."""
    if ctx.op is None:
        return False
    if "is_causal" in dict(schema_arguments(ctx.op)):
        return bool(argument(ctx.op, args, kwargs, "is_causal", False))
    return argument(ctx.op, args, kwargs, "custom_mask_type", 0) in (1, 2)


@register(aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
          aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
          aten._scaled_dot_product_fused_attention_overrideable)
def sdpa_forward(q, k, v, *args, out_shape, ctx, **kwargs) -> Flops:
    causal = _is_causal(ctx, (q, k, v) + args, kwargs)
    flops = attention_forward_flops(*_dims_bhtd(q, k, v))
    return Flops(attention=_causal_scale(flops, causal, ctx))


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward,
          aten._scaled_dot_product_flash_attention_backward,
          aten._scaled_dot_product_efficient_attention_backward,
          aten._scaled_dot_product_cudnn_attention_backward,
          aten._scaled_dot_product_fused_attention_overrideable_backward, wants_grad_mask=True)
def sdpa_backward(grad_out, q, k, v, *args, out_shape, ctx, **kwargs) -> Flops:
    causal = _is_causal(ctx, (grad_out, q, k, v) + args, kwargs)
    flops = attention_backward_flops(*_dims_bhtd(q, k, v), ctx.grad_mask)
    return Flops(attention=_causal_scale(flops, causal, ctx))


@register(aten._flash_attention_forward, aten._efficient_attention_forward)
def flash_forward(q, k, v, *args, out_shape, ctx, **kwargs) -> Flops:
    causal = _is_causal(ctx, (q, k, v) + args, kwargs)
    return Flops(attention=_causal_scale(attention_forward_flops(*_dims_bthd(q, k, v)), causal, ctx))


@register(aten._flash_attention_backward, aten._efficient_attention_backward, wants_grad_mask=True)
def flash_backward(grad_out, q, k, v, *args, out_shape, ctx, **kwargs) -> Flops:
    causal = _is_causal(ctx, (grad_out, q, k, v) + args, kwargs)
    flops = attention_backward_flops(*_dims_bthd(q, k, v), ctx.grad_mask)
    return Flops(attention=_causal_scale(flops, causal, ctx))
