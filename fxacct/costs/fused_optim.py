"""torch.optim's fused kernels (``fused=True``: Adam, AdamW, SGD, Adagrad): one op steps every
parameter of a group. Each is counted as the foreach step of the same optimizer counts (one FLOP
per element per _foreach_* op, fxacct.costs.pointwise.foreach), op for op from torch/optim's
_multi_tensor_* functions (non-capturable path), so ``fused=True`` and ``foreach=True`` agree. The
step counts' increment is its own _foreach_add_ before the fused call, counted there."""

import torch

from fxacct.costs.registry import Flops, numel, register

aten = torch.ops.aten


def _elements(params) -> int:
    return sum(numel(s) for s in params)


@register(aten._fused_adam_, aten._fused_adamw_)
def fused_adam(params, *args, out_shape, ctx, weight_decay=0.0, amsgrad=False, maximize=False, **kwargs) -> Flops:
    # _multi_tensor_adam: lerp (first moment), mul and addcmul (second), sqrt, div and add
    # (denominator), addcdiv (update): 7; weight decay's mul (AdamW) or add (Adam), amsgrad's
    # maximum, maximize's neg: 1 each
    per = 7 + (weight_decay != 0) + bool(amsgrad) + bool(maximize)
    return Flops(other=per * _elements(params))


@register(aten._fused_sgd_)
def fused_sgd(params, *args, out_shape, ctx, weight_decay=0.0, momentum=0.0, nesterov=False, maximize=False,
              is_first_step=False, **kwargs) -> Flops:
    # _multi_tensor_sgd: the update's add: 1; weight decay's add, maximize's neg: 1 each; momentum:
    # the buffer's mul and add (2; on the first step it is a clone of the gradient: 0) and
    # Nesterov's add (1)
    per = 1 + (weight_decay != 0) + bool(maximize)
    if momentum != 0:
        per += (0 if is_first_step else 2) + bool(nesterov)
    return Flops(other=per * _elements(params))


@register(aten._fused_adagrad_)
def fused_adagrad(params, *args, out_shape, ctx, weight_decay=0.0, maximize=False, **kwargs) -> Flops:
    # _multi_tensor_adagrad: addcmul (the sum of squares), sqrt and add (std), mul (the numerator),
    # addcdiv (update): 5; weight decay's add, maximize's neg: 1 each
    per = 5 + (weight_decay != 0) + bool(maximize)
    return Flops(other=per * _elements(params))
