"""GPT-2 fine-tuned with LoRA: frozen base weights, trainable low-rank adapters on attention.

Source: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021 (arXiv:2106.09685),
§4.1: a frozen weight W (out × in) is adapted as ``W + (alpha / r) · B A`` with A (r × in)
random and B (out × r) zero at initialisation, so the adapted model starts equal to the base one.
As in the paper's GPT experiments, only the attention projections are adapted: ``c_attn`` (the
fused q/k/v projection) and ``c_proj`` (the output projection) of every block. Every other
parameter, including the tied embedding / LM head, is frozen.

Trainable parameters at the defaults (r=8): per block r·(in + out) for each projection,
c_attn 8·(768 + 2304) = 24,576 and c_proj 8·(768 + 768) = 12,288, so 36,864 × 12 = 442,368.
"""

import math

import torch
import torch.nn as nn

if __package__:  # imported as examples.lora
    from .gpt2 import GPT
else:  # loaded as a file (an fxacct target): its directory is on sys.path
    from gpt2 import GPT


class LoRALinear(nn.Module):
    """``base(x) + (x Aᵀ Bᵀ) · alpha / r`` with ``base`` an nn.Linear (frozen by the caller)."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16, dropout: float = 0.0):
        super().__init__()
        if r <= 0:
            raise ValueError(f"LoRA rank r must be positive, got {r}")
        self.base = base
        self.r = r
        self.alpha = alpha
        self.scaling = alpha / r
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(base.out_features, r, **factory))
        self.lora_dropout = nn.Dropout(dropout)
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        # A: Kaiming-uniform as nn.Linear (and peft) initialise a weight; B: zeros, so B A = 0.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (…, in) @ (in, r) @ (r, out): two thin matmuls, never the out × in product B A.
        return self.base(x) + (self.lora_dropout(x) @ self.lora_A.T @ self.lora_B.T) * self.scaling

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}"


class LoRAGPT(GPT):
    """GPT-2 (examples/gpt2.py) with LoRA adapters on ``c_attn`` and ``c_proj`` of every block's
    attention; only ``lora_A`` / ``lora_B`` require grad."""

    def __init__(
        self,
        n_layer: int = 12,
        n_head: int = 12,
        n_embd: int = 768,
        vocab_size: int = 50257,
        block_size: int = 1024,
        bias: bool = True,
        dropout: float = 0.0,
        r: int = 8,
        alpha: float = 16,
        lora_dropout: float = 0.0,
    ):
        super().__init__(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
                         block_size=block_size, bias=bias, dropout=dropout)
        self.requires_grad_(False)  # freeze the base before the adapters exist
        for block in self.h:
            attn = block.attn
            attn.c_attn = LoRALinear(attn.c_attn, r, alpha, lora_dropout)
            attn.c_proj = LoRALinear(attn.c_proj, r, alpha, lora_dropout)

    def example_inputs(self, batch: int):
        return (torch.randint(0, self.vocab_size, (batch, self.block_size)),)
