"""Hugging Face models as people train them: tiny configs (built from config objects, no hub) of
every common family, accounted exactly as the eager run does (fxacct.trace.hf_eager).

Oracles, each independent of fxacct:
- activation bytes == ``torch.autograd.graph.saved_tensors_hooks`` on an eager CPU run of the same
  model with real weights (each storage once, parameters and buffers excluded);
- training and inference peaks within ±1% of fxacct/runtime/storage_tracker.py on that eager run;
- ``matmul + attention`` FLOPs, forward and backward, == ``FlopCounterMode`` on the meta-built model.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import flop_counter_oracle, meta_input, model_flops, on_meta
from test_memory_acceptance import activation_split, eager_saved_bytes

import fxacct
from fxacct.runtime.storage_tracker import measure_inference, measure_training_step

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # real Hugging Face models, each checked against an eager run

B, T, V = 2, 16, 128  # batch, sequence, vocabulary
DECODER = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=V, max_position_embeddings=64)


def _tokens():
    return {"input_ids": ("long", (B, T), V)}


def _seq2seq():
    return {"input_ids": ("long", (B, T), V), "decoder_input_ids": ("long", (B, T // 2), V)}


def _pixels(size: int = 32):
    return {"pixel_values": ("float", (B, 3, size, size), None)}


def _causal(name):
    return lambda: (getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM"))


# id -> (model factory on a fresh config, inputs {name: (kind, shape, bound)}, extra forward kwargs)
ZOO = {
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER)), _tokens, True),
    "llama-eager-attn": (lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**DECODER, attn_implementation="eager")), _tokens, True),
    "mistral": (lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**DECODER, sliding_window=8)),
                _tokens, True),
    "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**DECODER)), _tokens, True),
    "gemma": (lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**DECODER, head_dim=16)),
              _tokens, True),
    # layers alternate sliding-window (4 < T) and full attention, logits soft-capped
    "gemma2": (lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**DECODER, head_dim=16,
                                                                                 sliding_window=4)), _tokens, True),
    "mixtral": (lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **DECODER, num_local_experts=4, num_experts_per_tok=2, experts_implementation="batched_mm")),
        _tokens, True),
    # the default experts implementation, grouped_mm: torch's fake kernel of aten._grouped_mm takes
    # bfloat16 only (the CPU kernel takes float32 too), so this one runs in bfloat16.
    # FlopCounterMode has no formula for aten._grouped_mm: its FLOPs oracle is the batched_mm twin
    # above (the same experts' products, one bmm per routed token; TWIN below)
    "mixtral-grouped-mm-bf16": (lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **DECODER, num_local_experts=4, num_experts_per_tok=2)).to(torch.bfloat16), _tokens, True),
    "qwen2-moe": (lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=64, experts_implementation="batched_mm")), _tokens, True),
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, vocab_size=V, n_positions=64)), _tokens, True),
    "gpt2-eager-attn": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, vocab_size=V, n_positions=64, attn_implementation="eager")), _tokens, True),
    "gpt-neox": (lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=V,
        max_position_embeddings=64)), _tokens, True),
    "bert": (lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=V,
        max_position_embeddings=64)), _tokens, False),
    "t5": (lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=64, d_ff=96, d_kv=16, num_heads=4, vocab_size=V,
        decoder_start_token_id=0)), _seq2seq, True),
    "vit": (lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, image_size=32,
        patch_size=8, num_labels=10)), _pixels, False),
    "clip": (lambda: transformers.CLIPModel(transformers.CLIPConfig(
        text_config=dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         vocab_size=V, max_position_embeddings=64),
        vision_config=dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                           image_size=32, patch_size=8), projection_dim=32)),
             lambda: {**_tokens(), **_pixels()}, False),
    "whisper": (lambda: transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        encoder_layers=2, decoder_layers=2, d_model=64, encoder_ffn_dim=96, decoder_ffn_dim=96,
        encoder_attention_heads=4, decoder_attention_heads=4, num_mel_bins=16, max_source_positions=8,
        max_target_positions=32, vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1)),
        lambda: {"input_features": ("float", (B, 16, 16), None), "decoder_input_ids": ("long", (B, 8), V)},
        True),
}


def _inputs(spec: dict, device: str) -> dict:
    out = {}
    for name, (kind, shape, bound) in spec.items():
        if device == "meta":
            out[name] = meta_input(*shape, dtype=torch.long if kind == "long" else torch.float32)
        elif kind == "long":
            out[name] = torch.randint(0, bound, shape)
        else:
            out[name] = torch.randn(shape)
    return out


def _build(case: str):
    factory, spec, use_cache = ZOO[case]
    extra = {"use_cache": False} if use_cache else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = on_meta(factory)
        torch.manual_seed(0)
        model = factory()
    torch.manual_seed(1)
    return meta, model, {**_inputs(spec(), "meta"), **extra}, {**_inputs(spec(), "cpu"), **extra}


@pytest.fixture(scope="module", params=list(ZOO))
def zoo(request):
    meta, model, meta_kw, real_kw = _build(request.param)
    p = fxacct.profile_module(meta, (), meta_kw, fxacct.Config(batch=B, optimizer="adamw"))
    return request.param, meta, model, meta_kw, real_kw, p


def test_activation_bytes_equal_eager_saved_tensors(zoo):
    case, meta, model, _, real_kw, p = zoo
    assert model.training and meta.training  # dropout active on both sides
    total, by = eager_saved_bytes(model, (), real_kw)
    assert total > 0
    assert (p.memory.activation_bytes, activation_split(p)) == (total, by), case


def test_peaks_within_one_percent_of_the_storage_tracker(zoo):
    case, _, model, _, real_kw, p = zoo
    train = measure_training_step(model, (), lambda ps: torch.optim.AdamW(ps, lr=1e-3), kwargs=real_kw)
    model.zero_grad(set_to_none=True)
    infer = measure_inference(model, (), kwargs=real_kw)
    train_ratio = p.memory.peak_train.bytes / train.peak_bytes
    infer_ratio = p.memory.peak_inference.bytes / infer.peak_bytes
    print(f"{case}: peak_train {p.memory.peak_train.bytes:,} / {train.peak_bytes:,} = {train_ratio:.5f}; "
          f"peak_inference {p.memory.peak_inference.bytes:,} / {infer.peak_bytes:,} = {infer_ratio:.5f}")
    assert abs(train_ratio - 1) <= 0.01, (case, p.memory.peak_train.bytes, train.peak_bytes)
    assert abs(infer_ratio - 1) <= 0.01, (case, p.memory.peak_inference.bytes, infer.peak_bytes)


# a case whose ops FlopCounterMode cannot count: the case with the same products it can count
TWIN = {"mixtral-grouped-mm-bf16": "mixtral"}


def test_flops_equal_flop_counter_mode_on_meta(zoo):
    case, meta, _, meta_kw, _, p = zoo
    if case in TWIN:
        meta, _, meta_kw, _ = _build(TWIN[case])
    forward, backward = flop_counter_oracle(meta, (), meta_kw)
    totals = p.accounting.totals
    assert (model_flops(totals.forward), model_flops(totals.backward)) == (forward, backward), case


@pytest.mark.parametrize("case", ["llama", "bert"])
def test_a_given_attention_mask_is_accounted_as_a_padded_batch(case):
    # fxacct cannot know the values of a mask the user passes in, so transformers takes its general
    # path, the one an eager run takes when some token is padded: the account equals that run
    meta, model, meta_kw, real_kw = _build(case)
    meta_kw["attention_mask"] = meta_input(B, T, dtype=torch.long)
    p = fxacct.profile_module(meta, (), meta_kw, fxacct.Config(batch=B))
    padded = torch.ones(B, T, dtype=torch.long)
    padded[0, -1] = 0
    total, by = eager_saved_bytes(model, (), {**real_kw, "attention_mask": padded})
    assert (p.memory.activation_bytes, activation_split(p)) == (total, by)
    unpadded, _ = eager_saved_bytes(model, (), {**real_kw, "attention_mask": torch.ones(B, T, dtype=torch.long)})
    # an unpadded batch skips the mask (and, for Llama's grouped-query attention, repeat_kv): an
    # upper bound then (for BERT the mask is not saved, so the two are equal)
    assert unpadded < total if case == "llama" else unpadded == total


def test_known_values_answer_checks_eager_would_answer():
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from fxacct.trace.known_values import KnownValues, known

    with FakeTensorMode(), KnownValues():
        # find_packed_sequence_indices' test on arange position ids: not packed, in eager as here
        pos = torch.arange(8).unsqueeze(0).expand(2, -1)
        packed = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        assert bool((packed[:, -1] == 0).all()) is True
        restarted = torch.cat([torch.arange(3), torch.arange(5)]).unsqueeze(0)  # two packed sequences
        assert int(torch.diff(restarted).ne(1).sum()) == 1
        ones = torch.ones(2, 8, dtype=torch.long)
        ones[0, -1] = 0  # an in-place write of a known value keeps it known
        assert bool(torch.all(ones == 1)) is False
        unknown = torch.empty(2, 8)  # an uninitialised (or random, or user-given) value is no one's to know
        assert known(unknown) is None and known(unknown + pos) is None
        with pytest.raises(DataDependentOutputException):
            bool(unknown.sum() > 0)
        ones[1, 0] = unknown[0, 0]  # written from an unknown value: unknown from then on
        assert known(ones) is None


def test_a_large_batch_traces_the_attention_eager_runs(tmp_path, monkeypatch):
    """8,192 sequences of 16 tokens: Hugging Face's packed-sequence check reads [B, T] position ids
    (131,072 values, above the 65,536 fxacct once kept), and eager, which knows them, passes SDPA no
    mask. So must the trace: a check it cannot answer would send the model to its fallback, a
    [B, 1, T, T] mask materialized (at bench/speed.py's tiny Qwen2 on an H100 it cut the largest
    batch from 3,776 to 3,752)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, architectures=["Qwen2ForCausalLM"])
    config.save_pretrained(tmp_path)
    B, T = 8192, 16
    masks = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        masks.append(kwargs.get("attn_mask", args[3] if len(args) > 3 else None))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (B, T)))
    assert masks == [None]  # eager: causal attention without a mask
    monkeypatch.undo()
    p = fxacct.profile(fxacct.Config(target=f"hf:{tmp_path}", batch=B, seq_len=T))
    four_d_bool = [n.name for n in p.capture.graph.nodes if n.op == "call_function"
                   and getattr(n.meta.get("val"), "dtype", None) == torch.bool and len(n.meta["val"].shape) == 4]
    assert four_d_bool == []
