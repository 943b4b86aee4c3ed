"""A Llama-style decoder-only Transformer language model, written with einops.

Sources: Touvron et al., "LLaMA: Open and Efficient Foundation Language
Models", 2023 (pre-norm with RMSNorm, SwiGLU, rotary embeddings, no biases);
Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019; Su et al.,
"RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021;
Shazeer, "GLU Variants Improve Transformer", 2020. The layout follows the
Stanford CS336 assignment 1 model. Attention is computed explicitly with
``einops.einsum`` (no fused SDPA) so every matmul, the mask and the softmax
are visible to an op-level FLOP counter.
"""

import math

import einops
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * g`` with a learned gain ``g``."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x / rms * self.weight


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs ``(x[..., 2i], x[..., 2i+1])`` of ``x: (B, H, T, d_head)``
    by the angle ``t * theta^(-2i/d_head)`` for position ``t``.

    The cos/sin tables are built here from the (static) shape, so the model
    has no buffers that would need re-materialising after a meta-device build.
    """
    T, d_head = x.shape[-2], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d_head, 2, device=x.device, dtype=torch.float32) / d_head)
    angles = einops.einsum(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq, "t, f -> t f")
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # (T, d_head/2)
    x_pairs = einops.rearrange(x, "... t (f two) -> ... t f two", two=2)
    x1, x2 = x_pairs[..., 0], x_pairs[..., 1]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return einops.rearrange(rotated, "... t f two -> ... t (f two)")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE on queries and keys."""

    def __init__(self, d_model: int, n_heads: int, rope_theta: float):
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.output_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[-2]
        split = "b t (h d) -> b h t d"
        q = einops.rearrange(self.q_proj(x), split, h=self.n_heads)
        k = einops.rearrange(self.k_proj(x), split, h=self.n_heads)
        v = einops.rearrange(self.v_proj(x), split, h=self.n_heads)
        q, k = rope(q, self.rope_theta), rope(k, self.rope_theta)

        # Scaled dot-product attention, spelled out: softmax(QK^T / sqrt(d) + mask) V.
        scores = einops.einsum(q, k, "b h tq d, b h tk d -> b h tq tk") / math.sqrt(q.shape[-1])
        future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = einops.einsum(probs, v, "b h tq tk, b h tk d -> b h tq d")
        return self.output_proj(einops.rearrange(out, "b h t d -> b t (h d)"))


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``, the gated FFN of Shazeer (2020)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, rope_theta: float):
        super().__init__()
        self.ln1 = RMSNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, rope_theta)
        self.ln2 = RMSNorm(d_model)
        self.ffn = SwiGLU(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    """``forward(tokens: (B, T) long) -> logits (B, T, vocab_size)``; untied head."""

    def __init__(
        self,
        vocab_size: int = 10000,
        d_model: int = 512,
        n_layers: int = 4,
        n_heads: int = 8,
        d_ff: int = 1344,
        context_length: int = 256,
        rope_theta: float = 10000.0,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.token_embeddings = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            [TransformerBlock(d_model, n_heads, d_ff, rope_theta) for _ in range(n_layers)]
        )
        self.ln_final = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token_embeddings(tokens)  # (B, T, d_model)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))

    def example_inputs(self, batch: int):
        return (torch.randint(0, self.vocab_size, (batch, self.context_length)),)
