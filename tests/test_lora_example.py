"""examples/lora.py: GPT-2 with frozen base weights and LoRA adapters on c_attn / c_proj."""

import torch
from helpers import target

import fxacct
from examples.gpt2 import GPT
from examples.lora import LoRAGPT, LoRALinear

TINY = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=100, block_size=32, r=4, alpha=8)
# Per block, r=4, n_embd=64: c_attn A 4×64 + B 192×4 = 256 + 768 = 1,024;
#                            c_proj A 4×64 + B  64×4 = 256 + 256 =   512; 1,536 per block × 2 layers.
TINY_TRAINABLE = 3_072


def _trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def test_trainable_params_at_defaults(meta):
    model = meta(LoRAGPT)
    # Per block, r=8, n_embd=768: c_attn A 8×768 + B 2304×8 = 6,144 + 18,432 = 24,576;
    #                             c_proj A 8×768 + B  768×8 = 6,144 +  6,144 = 12,288;
    # 36,864 per block × 12 layers = 442,368.
    assert sum(p.numel() for p in _trainable(model).values()) == 442_368
    assert all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for n in _trainable(model))
    # the frozen base is GPT-2 124M unchanged (tied embedding counted once)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen == 124_439_808


def test_meta_build_and_example_inputs(meta):
    model = meta(LoRAGPT, **TINY)
    assert all(p.is_meta for p in model.parameters())
    with torch.device("meta"):
        (idx,) = model.example_inputs(3)
    assert idx.shape == (3, 32) and idx.dtype == torch.long and idx.is_meta
    assert isinstance(model.h[0].attn.c_attn, LoRALinear) and isinstance(model.h[1].attn.c_proj, LoRALinear)
    assert not isinstance(model.h[0].mlp.c_proj, LoRALinear)  # only the attention projections


def test_starts_equal_to_base_and_grads_only_adapters():
    torch.manual_seed(0)
    model = LoRAGPT(**TINY)
    base = GPT(**{k: v for k, v in TINY.items() if k not in ("r", "alpha")})
    # B = 0 at initialisation: the adapted model computes exactly the base model
    state = {k.replace(".base.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}
    base.load_state_dict(state)
    idx = torch.randint(0, 100, (2, 32))
    torch.testing.assert_close(model(idx), base(idx))

    model(idx).float().sum().backward()
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in ("lora_A", "lora_B"):
            assert p.grad is not None, name
        else:
            assert p.grad is None, name
    # B is zero, so dL/dA = 0 at the first step; dL/dB is not
    assert all(m.lora_B.grad.abs().sum() > 0 for m in model.modules() if isinstance(m, LoRALinear))
    assert sum(p.numel() for p in _trainable(model).values()) == TINY_TRAINABLE


def test_lora_linear_formula():
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5)
    lora = LoRALinear(base, r=2, alpha=3)
    torch.nn.init.normal_(lora.lora_B)
    x = torch.randn(4, 6)
    expected = base(x) + x @ (lora.lora_B @ lora.lora_A).T * (3 / 2)
    torch.testing.assert_close(lora(x), expected)


def test_fxacct_counts_adapter_gradients_only():
    p = fxacct.profile(fxacct.Config(target=target("examples/lora.py:LoRAGPT"), batch=1, kwargs=TINY))
    assert p.accounting.totals.trainable_params == TINY_TRAINABLE
    assert p.memory.grad_bytes == 4 * TINY_TRAINABLE  # fp32: gradients exist for the adapters only
