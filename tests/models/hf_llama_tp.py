"""A tiny Hugging Face Llama built from its config (no download): it carries transformers' own
tensor-parallel plan (config.base_model_tp_plan and _tp_plan), which --mesh tp=N applies."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make(layers: int = 2):
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        hidden_size=64, intermediate_size=128, vocab_size=256, max_position_embeddings=64, use_cache=False))

def example_inputs(batch):
    return (torch.randint(0, 256, (batch, 32)),)
