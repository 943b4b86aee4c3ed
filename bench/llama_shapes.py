"""Llama-2-shaped decoder models for the speed benchmark (written here; meta device only).

Llama-2-7B: d=4096, 32 layers, 32 heads, FFN 11008, vocab 32000. Llama-2-70B: d=8192, 80 layers,
64 query heads, 8 key/value heads (GQA), FFN 28672 (Touvron et al. 2023, table 1 and the model card).
"""
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rope(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d, h, kvh, ff):
        super().__init__()
        self.h, self.kvh, self.hd = h, kvh, d // h
        self.attn_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, kvh * self.hd, bias=False)
        self.wv = nn.Linear(d, kvh * self.hd, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.w1 = nn.Linear(d, ff, bias=False)
        self.w2 = nn.Linear(ff, d, bias=False)
        self.w3 = nn.Linear(d, ff, bias=False)

    def forward(self, x, cos, sin):
        B, T, D = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.wk(h).view(B, T, self.kvh, self.hd).transpose(1, 2)
        v = self.wv(h).view(B, T, self.kvh, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if self.kvh != self.h:
            k = k.repeat_interleave(self.h // self.kvh, 1)
            v = v.repeat_interleave(self.h // self.kvh, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.wo(a)
        return x + self.w2(F.silu(self.w1(self.ffn_norm(x))) * self.w3(self.ffn_norm(x)))


class Llama(nn.Module):
    def __init__(self, vocab=32000, d=4096, L=32, h=32, kvh=32, ff=11008, T=2048):
        super().__init__()
        self.T, self.vocab, self.hd = T, vocab, d // h
        self.tok = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, h, kvh, ff) for _ in range(L))
        self.norm = RMSNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        T = idx.shape[1]
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2, device=idx.device).float() / self.hd))
        f = torch.outer(torch.arange(T, device=idx.device).float(), inv)
        cos, sin = f.cos(), f.sin()
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.out(self.norm(x))

    def example_inputs(self, batch):
        return (torch.randint(0, self.vocab, (batch, self.T)),)

SHAPES = {
    "llama2-7b": dict(vocab=32000, d=4096, L=32, h=32, kvh=32, ff=11008),
    "llama2-70b": dict(vocab=32000, d=8192, L=80, h=64, kvh=8, ff=28672),
}


def hf_llama_config(shape: str):
    """A transformers LlamaConfig of the same dimensions (the HF case of bench/speed.py)."""
    from transformers import LlamaConfig

    s = SHAPES[shape]
    return LlamaConfig(vocab_size=s["vocab"], hidden_size=s["d"], num_hidden_layers=s["L"],
                       num_attention_heads=s["h"], num_key_value_heads=s["kvh"], intermediate_size=s["ff"],
                       max_position_embeddings=4096, use_cache=False)
