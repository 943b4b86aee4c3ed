"""Eager, meta-device and fake-tensor sanity checks for the example models.

These tests use only PyTorch (no fxacct), so they pin down the examples
themselves: small configs run forward + backward on CPU, default configs have
the documented parameter counts (built on the meta device, so no memory is
allocated), and ``example_inputs`` / ``forward`` work on meta and fake tensors.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from examples.deep_linear import DeepLinearModel
from examples.gpt2 import GPT
from examples.mlp import MLP
from examples.resnet import ResNet18
from examples.transformer_lm import TransformerLM
from examples.two_layer import TwoLayer

# (class, small kwargs, expected output shape for batch=2 at the small config)
SMALL = [
    (TwoLayer, {}, (2, 2)),
    (DeepLinearModel, {}, (2, 3)),
    (MLP, dict(d_model=32, d_hidden=64, n_blocks=2), (2, 32)),
    (ResNet18, dict(num_classes=10, image_size=32, width=8), (2, 10)),
    (GPT, dict(n_layer=2, n_head=4, n_embd=64, vocab_size=100, block_size=32), (2, 32, 100)),
    (
        TransformerLM,
        dict(vocab_size=100, d_model=64, n_layers=2, n_heads=4, d_ff=96, context_length=16),
        (2, 16, 100),
    ),
]
SMALL_IDS = [cls.__name__ for cls, _, _ in SMALL]
ALL_CLASSES = [cls for cls, _, _ in SMALL]

# Last output dimension of each model at its default config.
DEFAULT_OUT_DIM = {
    TwoLayer: 2,
    DeepLinearModel: 3,
    MLP: 1024,
    ResNet18: 1000,
    GPT: 50257,
    TransformerLM: 10000,
}


@pytest.mark.parametrize("cls,kwargs,out_shape", SMALL, ids=SMALL_IDS)
def test_small_forward_backward(cls, kwargs, out_shape):
    torch.manual_seed(0)
    model = cls(**kwargs)
    inputs = model.example_inputs(2)
    assert isinstance(inputs, tuple)
    out = model(*inputs)
    assert out.shape == out_shape
    assert torch.isfinite(out).all()
    out.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{cls.__name__}.{name} got no gradient"


# Unique parameter counts at the default configs.
#
# DeepLinearModel(3, 3, 4): 4 weight matrices of 3x3 = 36, plus bias 3  ->  39.
#
# GPT-2 small (n_layer=12, n_embd=768, vocab=50257, block_size=1024, bias=True);
# lm_head.weight is tied to wte.weight, so it is counted once:
#   wte  50257*768                           = 38,597,376
#   wpe   1024*768                           =    786,432
#   per block:
#     ln_1        2*768                      =      1,536
#     attn.c_attn 768*2304 + 2304            =  1,771,776
#     attn.c_proj 768*768  + 768             =    590,592
#     ln_2        2*768                      =      1,536
#     mlp.c_fc    768*3072 + 3072            =  2,362,368
#     mlp.c_proj  3072*768 + 768             =  2,360,064
#     block total                            =  7,087,872
#   12 blocks                                = 85,054,464
#   ln_f 2*768                               =      1,536
#   total 38,597,376 + 786,432 + 85,054,464 + 1,536 = 124,439,808
#
# ResNet18: torchvision's resnet18 count, 11,689,512.
#
# MLP(1024, 4096, 4): per block 2*1024 + (1024*4096 + 4096) + (4096*1024 + 1024)
#   = 8,395,776; 4 blocks = 33,583,104; final LayerNorm 2,048 -> 33,585,152.
#
# TransformerLM defaults: embeddings + untied head 2*10000*512 = 10,240,000;
#   per layer 4*512*512 + 3*512*1344 + 2*512 = 3,113,984, x4 = 12,455,936;
#   final RMSNorm 512 -> 22,696,448.
DEFAULT_PARAM_COUNTS = [
    (TwoLayer, 3 * 3 + 3 * 2),
    (DeepLinearModel, 39),
    (MLP, 33_585_152),
    (ResNet18, 11_689_512),
    (GPT, 124_439_808),
    (TransformerLM, 22_696_448),
]


@pytest.mark.parametrize(
    "cls,expected", DEFAULT_PARAM_COUNTS, ids=[c.__name__ for c, _ in DEFAULT_PARAM_COUNTS]
)
def test_default_param_count_on_meta(cls, expected):
    with torch.device("meta"):
        model = cls()
    assert all(p.is_meta for p in model.parameters())
    # .parameters() yields each Parameter once, so tied weights count once.
    assert sum(p.numel() for p in model.parameters()) == expected


def test_gpt_weight_tying():
    with torch.device("meta"):
        model = GPT()
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_example_inputs_on_meta(cls):
    with torch.device("meta"):
        model = cls()
        inputs = model.example_inputs(4)
    assert isinstance(inputs, tuple) and len(inputs) >= 1
    for t in inputs:
        assert isinstance(t, torch.Tensor) and t.is_meta
        assert t.shape[0] == 4


@pytest.mark.parametrize("cls,kwargs,out_shape", SMALL, ids=SMALL_IDS)
def test_example_inputs_follow_kwargs(cls, kwargs, out_shape):
    """example_inputs reads the config, so small kwargs give small inputs."""
    with torch.device("meta"):
        model = cls(**kwargs)
        (x,) = model.example_inputs(2)
    assert x.shape[0] == 2
    if x.dtype == torch.long:  # token inputs: sequence length follows the config
        assert x.shape[1] == out_shape[1]


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_default_forward_on_meta(cls):
    """forward at the default config runs on meta tensors (no allocation)."""
    with torch.device("meta"):
        model = cls()
        out = model(*model.example_inputs(2))
    assert out.is_meta
    assert out.shape[0] == 2 and out.shape[-1] == DEFAULT_OUT_DIM[cls]


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_default_forward_under_fake_tensor_mode(cls):
    """forward traces on fake tensors: no .item(), no data-dependent control flow."""
    with torch.device("meta"):
        model = cls()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # Parameters come from the meta model, so make the inputs on meta too (this is
    # how fxacct calls example_inputs), then fakify everything.
    with mode, torch.device("meta"):
        params = {n: mode.from_tensor(p) for n, p in model.named_parameters(remove_duplicate=False)}
        buffers = {n: mode.from_tensor(b) for n, b in model.named_buffers()}
        inputs = model.example_inputs(2)
        out = torch.func.functional_call(model, {**params, **buffers}, inputs)
    assert out.shape[0] == 2 and out.shape[-1] == DEFAULT_OUT_DIM[cls]


def test_llama_norm_float32_is_torchtitans_rmsnorm():
    """examples/llama.py ``norm_float32``: RMSNorm normalized in float32 and cast back before the
    weight (torchtitan 2024-12); checked against torch's own F.rms_norm run in float32, which the
    bfloat16 path (the default) does not match on the same input."""
    from examples.llama import Llama, RMSNorm

    torch.manual_seed(0)
    x = (torch.randn(4, 64) * 3).to(torch.bfloat16)
    norm = RMSNorm(64, in_float32=True).to(torch.bfloat16)
    expected = torch.nn.functional.rms_norm(x.float(), (64,), eps=1e-5).to(torch.bfloat16) * norm.weight
    assert torch.equal(norm(x), expected)
    assert not torch.equal(RMSNorm(64).to(torch.bfloat16)(x), expected)
    model = Llama(norm_float32=True)
    assert all(m.in_float32 for m in model.modules() if isinstance(m, RMSNorm)) and len(
        [m for m in model.modules() if isinstance(m, RMSNorm)]) == 5  # 2 per block, 2 blocks, the final one
