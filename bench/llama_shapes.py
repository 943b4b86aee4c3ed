"""Llama-2-shaped decoder models for the speed benchmark (written here; meta device only).

Llama-2-7B: d=4096, 32 layers, 32 heads, FFN 11008, vocab 32000. Llama-2-70B: d=8192, 80 layers,
64 query heads, 8 key/value heads (GQA), FFN 28672 (Touvron et al. 2023, table 1 and the model card).
"""
import torch, torch.nn as nn, torch.nn.functional as F
class RMSNorm(nn.Module):
    def __init__(s, d): super().__init__(); s.weight = nn.Parameter(torch.ones(d))
    def forward(s, x): return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * s.weight
def rope(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1*cos - x2*sin, x1*sin + x2*cos), -1).flatten(-2)
class Block(nn.Module):
    def __init__(s, d, h, kvh, ff):
        super().__init__(); s.h, s.kvh, s.hd = h, kvh, d//h
        s.attn_norm = RMSNorm(d); s.ffn_norm = RMSNorm(d)
        s.wq = nn.Linear(d, d, bias=False); s.wk = nn.Linear(d, kvh*s.hd, bias=False); s.wv = nn.Linear(d, kvh*s.hd, bias=False); s.wo = nn.Linear(d, d, bias=False)
        s.w1 = nn.Linear(d, ff, bias=False); s.w2 = nn.Linear(ff, d, bias=False); s.w3 = nn.Linear(d, ff, bias=False)
    def forward(s, x, cos, sin):
        B, T, D = x.shape
        h = s.attn_norm(x)
        q = s.wq(h).view(B, T, s.h, s.hd).transpose(1, 2); k = s.wk(h).view(B, T, s.kvh, s.hd).transpose(1, 2); v = s.wv(h).view(B, T, s.kvh, s.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if s.kvh != s.h:
            k = k.repeat_interleave(s.h // s.kvh, 1); v = v.repeat_interleave(s.h // s.kvh, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + s.wo(a)
        return x + s.w2(F.silu(s.w1(s.ffn_norm(x))) * s.w3(s.ffn_norm(x)))
class Llama(nn.Module):
    def __init__(s, vocab=32000, d=4096, L=32, h=32, kvh=32, ff=11008, T=2048):
        super().__init__(); s.T, s.vocab = T, vocab
        s.tok = nn.Embedding(vocab, d); s.layers = nn.ModuleList(Block(d, h, kvh, ff) for _ in range(L)); s.norm = RMSNorm(d); s.out = nn.Linear(d, vocab, bias=False)
        s.hd = d // h
    def forward(s, idx):
        T = idx.shape[1]
        inv = 1.0 / (10000 ** (torch.arange(0, s.hd, 2, device=idx.device).float() / s.hd))
        f = torch.outer(torch.arange(T, device=idx.device).float(), inv)
        cos, sin = f.cos(), f.sin()
        x = s.tok(idx)
        for l in s.layers: x = l(x, cos, sin)
        return s.out(s.norm(x))
    def example_inputs(s, batch): return (torch.randint(0, s.vocab, (batch, s.T)),)


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
