"""fxacct's matmul + attention FLOPs equal torch.utils.flop_counter.FlopCounterMode's totals
(DESIGN.md: "With them, matmul + attention equals what FlopCounterMode reports for the same model
built on the meta device, however the CPU kernels differ"), forward and backward separately.

The oracle (helpers.flop_counter_oracle) runs the meta-built model under FakeTensorMode, where
SDPA takes the math path (bmm) that FlopCounterMode counts, while fxacct traces on fake CPU
tensors where SDPA is a fused flash kernel: the agreement checks the attention formula too.
"""

import warnings

import pytest
import torch
from helpers import SMALL_EXAMPLES, config, flop_counter_oracle, load, meta_input, model_flops, on_meta, target

import fxacct


@pytest.mark.parametrize("name", list(SMALL_EXAMPLES))
def test_examples_match_flop_counter(name):
    cfg = config(name, batch=2)
    model, args, kwargs = load(cfg)
    p = fxacct.profile_module(model, args, kwargs, cfg)
    fwd, bwd = flop_counter_oracle(model, args, kwargs)
    t = p.accounting.totals
    assert fwd > 0 and bwd > 0
    assert (model_flops(t.forward), model_flops(t.backward)) == (fwd, bwd)
    assert p.accounting.unsupported_ops == {}


@pytest.mark.parametrize("name", ["TwoLayer", "MLP", "ResNet18", "GPT"])
def test_examples_match_flop_counter_with_input_grad(name):
    """With input_requires_grad the first layer's dX is counted too, on both sides."""
    cfg = config(name, batch=2, input_requires_grad=True)
    model, args, kwargs = load(cfg)
    p = fxacct.profile_module(model, args, kwargs, cfg)
    fwd, bwd = flop_counter_oracle(model, args, kwargs, input_grads=True)
    t = p.accounting.totals
    assert (model_flops(t.forward), model_flops(t.backward)) == (fwd, bwd)


def _hf_gpt2(attn):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=64,
                     bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = attn
    return GPT2LMHeadModel(cfg)


def _hf_llama(attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    # grouped-query attention (2 kv heads for 4 query heads) exercises the GQA path of SDPA
    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                      intermediate_size=96, vocab_size=128, max_position_embeddings=64)
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg)


@pytest.mark.slow  # Hugging Face models; test_examples_match_flop_counter stays fast
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("factory", [_hf_gpt2, _hf_llama], ids=["GPT2LMHeadModel", "LlamaForCausalLM"])
def test_hugging_face_models_match_flop_counter(factory, attn):
    pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = on_meta(factory, attn)
    assert model.config._attn_implementation == attn
    kwargs = {"input_ids": meta_input(2, 16, dtype=torch.long), "use_cache": False}
    p = fxacct.profile_module(model, (), kwargs, fxacct.Config(batch=2))
    fwd, bwd = flop_counter_oracle(model, (), kwargs, output=lambda o: o.logits)
    t = p.accounting.totals
    assert fwd > 0
    assert (model_flops(t.forward), model_flops(t.backward)) == (fwd, bwd)
    assert t.tokens_per_example == 16
    assert p.accounting.unsupported_ops == {}  # e.g. aten._safe_softmax on SDPA's masked math path


# GPT-2 124M (n_layer=12, n_embd=768, vocab 50257), batch 1, T = 1024, 2 FLOPs per multiply-add:
#   per layer, linear layers: 2·T·768·(2304 + 768 + 3072 + 3072)   (c_attn, attn.c_proj, c_fc, mlp.c_proj)
#                             = 2·1024·768·9216 = 14,495,514,624;  × 12 = 173,946,175,488
#   per layer, attention:     2·2·T·T·768 (QKᵀ and PV, non-causal) = 3,221,225,472;  × 12 = 38,654,705,664
#   lm_head:                  2·T·768·50257 = 79,047,426,048
#   forward = 173,946,175,488 + 38,654,705,664 + 79,047,426,048 = 291,648,307,200
#   backward = 2 × forward (every matmul's input needs a grad: it descends from the embeddings),
#   forward + backward = 3 × 291,648,307,200 = 874,944,921,600
GPT2_124M_FORWARD = 291_648_307_200
GPT2_124M_TRAIN = 874_944_921_600


@pytest.fixture(scope="module")
def gpt2_124m():
    return fxacct.profile(fxacct.Config(target=target("examples/gpt2.py:GPT"), batch=1))


def test_gpt2_124m_acceptance(gpt2_124m):
    t = gpt2_124m.accounting.totals
    assert t.forward.attention == 38_654_705_664
    assert t.forward.matmul == 173_946_175_488 + 79_047_426_048
    assert model_flops(t.forward) == GPT2_124M_FORWARD
    assert model_flops(t.forward) + model_flops(t.backward) == GPT2_124M_TRAIN
    assert t.model_flops == GPT2_124M_TRAIN
    assert t.tokens_per_example == 1024


def test_gpt2_124m_matches_flop_counter(gpt2_124m):
    from examples.gpt2 import GPT

    model = on_meta(GPT)
    fwd, bwd = flop_counter_oracle(model, (meta_input(1, 1024, dtype=torch.long),))
    assert (fwd, fwd + bwd) == (GPT2_124M_FORWARD, GPT2_124M_TRAIN)
