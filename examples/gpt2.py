"""GPT-2 (124M at the defaults), written in the style of nanoGPT.

Sources: Radford et al., "Language Models are Unsupervised Multitask
Learners", 2019; Karpathy, nanoGPT (github.com/karpathy/nanoGPT, model.py).
Differences from nanoGPT: flat constructor kwargs instead of a config object,
and ``forward(idx)`` always returns logits for all T positions (no loss).
The LM head shares its weight with the token embedding (weight tying), so the
unique parameter count at the defaults is 124,439,808.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention using PyTorch's fused SDPA."""

    def __init__(self, n_embd: int, n_head: int, bias: bool, dropout: float):
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head = n_head
        self.n_embd = n_embd
        self.dropout = dropout
        # Query, key and value projections for all heads, in one matmul.
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        # Output projection.
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, sequence length, embedding dim (n_embd)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all heads
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network with a 4x expansion."""

    def __init__(self, n_embd: int, bias: bool, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm Transformer block."""

    def __init__(self, n_embd: int, n_head: int, bias: bool, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias, dropout)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, bias, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """GPT-2 language model: ``forward(idx: (B, T) long) -> logits (B, T, vocab)``."""

    def __init__(
        self,
        n_layer: int = 12,
        n_head: int = 12,
        n_embd: int = 768,
        vocab_size: int = 50257,
        block_size: int = 1024,
        bias: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.n_layer = n_layer
        self.n_head = n_head
        self.n_embd = n_embd
        self.vocab_size = vocab_size
        self.block_size = block_size

        self.wte = nn.Embedding(vocab_size, n_embd)  # token embedding
        self.wpe = nn.Embedding(block_size, n_embd)  # learned position embedding
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(n_embd, n_head, bias, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        # Weight tying (Press & Wolf, 2017): one matrix for embedding and unembedding.
        self.lm_head.weight = self.wte.weight

        # GPT-2 initialisation: N(0, 0.02), with residual projections scaled
        # down by 1/sqrt(2 * n_layer).
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.size()
        assert T <= self.block_size, f"sequence length {T} > block_size {self.block_size}"
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)  # (B, T, vocab_size)

    def example_inputs(self, batch: int):
        return (torch.randint(0, self.vocab_size, (batch, self.block_size)),)
