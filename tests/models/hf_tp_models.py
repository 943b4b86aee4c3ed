"""Tiny Hugging Face models built from their configs (no download), each carrying transformers'
own tensor-parallel plan, with the styles fxacct once had to map itself: Qwen3's per-head norms
("replicated_with_grad_allreduce"), Mixtral's experts ("packed_colwise" on a parameter,
"moe_tp_experts"; its default experts implementation, grouped_mm, takes bf16 only; batched_mm
any dtype), Gemma2's
embedding tied to the head. Same vocabulary and sequence length for all: one example_inputs."""

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB, SEQ = 256, 16
COMMON = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, head_dim=16,
              vocab_size=VOCAB, max_position_embeddings=64, use_cache=False)


def qwen3():
    return Qwen3ForCausalLM(Qwen3Config(intermediate_size=96, **COMMON))


def mixtral(experts_implementation=None):
    return MixtralForCausalLM(MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                            experts_implementation=experts_implementation, **COMMON))


def mixtral_batched_mm():
    """The same Mixtral, its experts as batched matmuls (any dtype)."""
    return mixtral("batched_mm")


def gemma2():
    return Gemma2ForCausalLM(Gemma2Config(intermediate_size=96, **COMMON))


def example_inputs(batch):
    return (torch.randint(0, VOCAB, (batch, SEQ)),)
