"""Target-device rules: what a CUDA GPU runs differently from the CPU fxacct traces on.

Tracing happens on CPU fake tensors (backward on fake "cuda" tensors needs a GPU), so where CUDA
picks other kernels, ``cuda_rules`` swaps them in at the torch-function level, before autograd
records anything; what is saved for backward then follows the CUDA kernel exactly. Each rule
names its source.

1. scaled_dot_product_attention: CUDA runs the flash kernel when there is no mask, q is fp16 or
   bf16 and the head dim is at most 256; otherwise the memory-efficient kernel (which takes masks
   and fp32). Both save output + logsumexp, never the probability matrix
   (torch/nn/attention docs; aten/src/ATen/native/transformers/cuda/sdp_utils.cpp checks).
2. dropout: CUDA's fused kernel (aten.native_dropout) saves a 1-byte bool mask; the CPU path
   (at::native::dropout → _dropout_impl) saves a full-precision scaled noise tensor
   (aten/src/ATen/native/Dropout.cpp, is_fused_kernel_acceptable: CUDA/XPU only).
3. autocast: CUDA autocast runs the ops of its float32 list in float32 where CPU autocast keeps
   the lower precision (PyTorch AMP docs, "CUDA Ops that can autocast to float32").
4. optimizers: on CUDA tensors torch.optim defaults to the foreach implementation
   (torch/optim/optimizer.py, _default_to_fused_or_foreach); applied in fxacct.trace.optim_step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# PyTorch AMP docs, "CUDA Ops that can autocast to float32" (the names as torch functions)
CUDA_AUTOCAST_FP32 = frozenset({
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits",
    "cosh", "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum",
    "dist", "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss",
    "layer_norm", "log", "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss",
    "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
    "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss",
    "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan", "triplet_margin_loss",
})

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def _to_fp32(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float32:
        return x.float()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_fp32(v) for v in x)
    return x


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    if not query.dim() == key.dim() == value.dim() == 4:
        # every fused kernel takes (B, H, T, D) alone; CUDA runs others on its math path, as the CPU does
        # (ATen/native/transformers/sdp_utils_cpp.h, check_tensor_shapes)
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, -3)
        value = value.repeat_interleave(groups, -3)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if attn_mask is None and query.dtype in FLASH_DTYPES and query.shape[-1] <= FLASH_MAX_HEAD_DIM:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:  # sdp_utils: boolean masks become -inf biases
        bias = torch.zeros(bias.shape, dtype=query.dtype).masked_fill(bias.logical_not(), float("-inf"))
    if bias is not None:
        bias = bias.expand(*query.shape[:-1], key.shape[-2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, needs_grad, dropout_p, is_causal, scale=scale)[0]


class CudaRules(TorchFunctionMode):
    """Active during a capture for a CUDA target (``--gpu``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return cuda_sdpa(*args, **kwargs)
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        if torch.is_autocast_enabled("cpu") and getattr(func, "__name__", "") in CUDA_AUTOCAST_FP32:
            with torch.autocast("cpu", enabled=False):
                return func(*_to_fp32(args), **{k: _to_fp32(v) for k, v in kwargs.items()})
        return func(*args, **kwargs)

    @staticmethod
    def _dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return input
        return torch.ops.aten.native_dropout(input, p, True)[0]
