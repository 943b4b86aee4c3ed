"""SDPA's math path (the CPU with dropout, some masks) is still attention: its bmm ops inside
F.scaled_dot_product_attention are counted in the attention class, forward and backward."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxacct


class MathPathAttention(nn.Module):
    """dropout_p > 0 in training: the CPU runs SDPA as bmm + softmax + dropout + bmm."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)  # (B, H=2, T, 8)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


def test_math_path_products_are_attention():
    with torch.device("meta"):
        model = MathPathAttention()
    x = torch.empty(2, 8, 16, device="meta")
    t = fxacct.profile_module(model, (x,), {}, fxacct.Config(batch=2)).accounting.totals
    # B=2, H=2, T=8, d=8: QKᵀ 2·2·2·8·8·8 = 4,096 and PV 4,096 -> 8,192; qkv Linear 2·16·16·48 = 24,576
    assert t.forward.attention == 8_192
    assert t.forward.matmul == 24_576
    # backward, q, k, v all need grads: 2x the forward attention; the Linear's dW only (x needs none)
    assert t.backward.attention == 16_384
    assert t.backward.matmul == 24_576


def test_hugging_face_gpt2_attention_is_counted_as_attention():
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=1000))
    kwargs = {"input_ids": torch.empty(2, 32, dtype=torch.long, device="meta"), "use_cache": False}
    t = fxacct.profile_module(model, (), kwargs, fxacct.Config(batch=2)).accounting.totals
    # 2 layers · B=2 · H=4 · T=32 · T=32 · (d 16 + 16) · 2 FLOPs = 1,048,576 (dropout 0.1: math path)
    assert t.forward.attention == 1_048_576
    assert t.backward.attention == 2 * 1_048_576
