"""nn.MultiheadAttention's products (QKᵀ and PV) count as attention on every path it takes:
dropout or not (SDPA's fused kernel or its math path), need_weights or not (F.multi_head_attention_
forward's own baddbmm/bmm path), and the totals are what FlopCounterMode counts."""

import pytest
import torch
import torch.nn as nn
from helpers import flop_counter_oracle, model_flops

import fxacct

B, T, E, H = 2, 16, 32, 4
D = E // H


class MHA(nn.Module):
    def __init__(self, dropout, need_weights):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H, dropout=dropout, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x):
        return self.attn(x, x, x, need_weights=self.need_weights)[0]


@pytest.mark.parametrize("gpu", [None, "h100"])  # CPU rules, CUDA rules (fxacct.trace.targets)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_products_are_attention(dropout, need_weights, gpu):
    with torch.device("meta"):
        model = MHA(dropout, need_weights)
    x = torch.empty(B, T, E, device="meta")
    cfg = fxacct.Config(batch=B, gpu=gpu, find_max_batch=False)
    t = fxacct.profile_module(model, (x,), {}, cfg).accounting.totals
    # closed form: QKᵀ and PV, 2·B·H·T·T·d each -> 2·2·2·4·16·16·8 = 65,536
    assert t.forward.attention == 2 * 2 * B * H * T * T * D == 65_536
    # in-projection 2·(B·T)·E·3E = 196,608 and out-projection 2·(B·T)·E·E = 65,536
    assert t.forward.matmul == 2 * B * T * E * 3 * E + 2 * B * T * E * E == 262_144
    # q, k, v all need gradients: two products per forward product
    assert t.backward.attention == 2 * 65_536
    fwd, bwd = flop_counter_oracle(model, (x,))
    assert model_flops(t.forward) == fwd
    assert model_flops(t.backward) == bwd


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_transformer_encoder_layer_attention(dropout):
    with torch.device("meta"):
        model = nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=dropout, batch_first=True)
    x = torch.empty(B, T, E, device="meta")
    t = fxacct.profile_module(model, (x,), {}, fxacct.Config(batch=B)).accounting.totals
    assert t.forward.attention == 65_536  # as above: the encoder layer passes need_weights=False
    fwd, bwd = flop_counter_oracle(model, (x,))
    assert model_flops(t.forward) == fwd
    assert model_flops(t.backward) == bwd


def test_encoder_layer_fast_path_is_named_and_eager_without_it_matches():
    """In eval under no_grad, eager nn.TransformerEncoderLayer runs one fused kernel
    (aten._transformer_encoder_layer_fwd) where fxacct's capture (under a torch function mode,
    which turns the fast path off) traces the ops it replaces: the profile says so, and eager with
    the fast path off runs exactly the traced ops, so its op-level inference peak is fxacct's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fxacct.runtime.storage_tracker import measure_inference

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 64, batch_first=True)
    x = torch.randn(B, T, E)
    with torch.device("meta"):
        meta_layer = nn.TransformerEncoderLayer(E, H, 64, batch_first=True)
    cfg = fxacct.Config(batch=B)
    on = fxacct.profile_module(meta_layer, (x.to("meta"),), {}, cfg)
    assert [w for w in on.warnings if "fast path" in w]
    layer.eval()
    with torch.no_grad(), Seen() as seen:
        layer(x)
    assert torch.ops.aten._transformer_encoder_layer_fwd.default in seen.ops
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        measured = measure_inference(layer, (x,)).peak_bytes
        off = fxacct.profile_module(meta_layer, (x.to("meta"),), {}, cfg)
    finally:
        torch.backends.mha.set_fastpath_enabled(before)
    assert not [w for w in off.warnings if "fast path" in w]
    assert on.memory.peak_inference.bytes == measured
