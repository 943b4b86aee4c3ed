"""Hypothesis properties of the account: closed forms for single ops, backward = 2× forward for a
matmul whose input needs a grad, linearity in batch, views are free, node and module rows against
FlopCounterMode, per-layer closed forms and eager saved tensors, and agreement with FlopCounterMode
on random stacks.

Every module here is built on the meta device with meta inputs (helpers.on_meta, meta_input).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
    SMALL_EXAMPLES,
    config,
    eager_saved_bytes,
    flop_counter_forward_by_module,
    flop_counter_oracle,
    load,
    meta_input,
    model_flops,
    on_meta,
    profile_meta,
    real_model,
)
from hypothesis import given
from hypothesis import strategies as st
from strategies import bmm_shapes, conv2d_configs, conv_stacks, matmul_shapes, mlp_stacks

import fxacct


# ---------------------------------------------------------------- single ops: closed forms
class MM(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.w = nn.Parameter(torch.empty(k, n))

    def forward(self, x):
        return torch.mm(x, self.w)


class BMM(nn.Module):
    def __init__(self, b, k, n):
        super().__init__()
        self.w = nn.Parameter(torch.empty(b, k, n))

    def forward(self, x):
        return torch.bmm(x, self.w)


class AddMM(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.w = nn.Parameter(torch.empty(k, n))
        self.bias = nn.Parameter(torch.empty(n))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.w)


class FLinear(nn.Module):
    def __init__(self, k, n, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, k))
        self.bias = nn.Parameter(torch.empty(n)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def _ops(p: fxacct.Profile, phase: str) -> list[str]:
    return [str(n.target) for n in p.capture.graph.nodes
            if n.op == "call_function" and "fxacct" in n.meta and n.meta["fxacct"].phase == phase]


@given(matmul_shapes())
def test_mm_closed_form(shape):
    m, k, n = shape
    p = profile_meta(on_meta(MM, k, n), (meta_input(m, k),))
    t = p.accounting.totals
    # forward (m,k)@(k,n): 2·m·k·n; backward dW = xᵀ (k,m) @ dy (m,n): 2·k·m·n (no dx)
    assert (t.forward.matmul, t.forward.attention, t.forward.other) == (2 * m * k * n, 0, 0)
    assert (t.backward.matmul, t.backward.attention) == (2 * m * k * n, 0)


@given(bmm_shapes())
def test_bmm_closed_form(shape):
    b, m, k, n = shape
    p = profile_meta(on_meta(BMM, b, k, n), (meta_input(b, m, k),), input_requires_grad=True)
    t = p.accounting.totals
    # forward 2·b·m·k·n; backward dX = dy @ wᵀ and dW = xᵀ @ dy, each 2·b·m·k·n
    assert t.forward.matmul == 2 * b * m * k * n
    assert t.backward.matmul == 2 * 2 * b * m * k * n


@given(matmul_shapes())
def test_addmm_closed_form(shape):
    m, k, n = shape
    p = profile_meta(on_meta(AddMM, k, n), (meta_input(m, k),))
    t = p.accounting.totals
    # the product 2·m·k·n is matmul; the fused bias add, one per output element, is other
    assert "aten.addmm.default" in _ops(p, "forward")
    assert (t.forward.matmul, t.forward.other) == (2 * m * k * n, m * n)
    assert t.backward.matmul == 2 * m * k * n  # dW only


@given(matmul_shapes(), st.integers(1, 3), st.booleans())
def test_linear_closed_form(shape, lead, bias):
    # F.linear over a (lead, m, k) input folds the leading dims: (lead·m, k) @ (k, n)
    m, k, n = shape
    p = profile_meta(on_meta(FLinear, k, n, bias), (meta_input(lead, m, k),), input_requires_grad=True)
    t = p.accounting.totals
    rows = lead * m
    assert t.forward.matmul == 2 * rows * k * n
    assert t.forward.other == (rows * n if bias else 0)
    assert t.backward.matmul == 2 * 2 * rows * k * n  # dX and dW


@given(conv2d_configs())
def test_conv2d_closed_form(c):
    conv = on_meta(nn.Conv2d, c.c_in, c.c_out, c.kernel, stride=c.stride, padding=c.padding,
                   groups=c.groups, bias=c.bias)
    p = profile_meta(conv, (meta_input(c.batch, c.c_in, c.height, c.width),), input_requires_grad=True)
    t = p.accounting.totals
    h_out, w_out = c.out_hw
    # every output element: (c_in/groups)·kh·kw multiply-adds
    macs = c.batch * c.c_out * h_out * w_out * (c.c_in // c.groups) * c.kernel[0] * c.kernel[1]
    assert t.forward.matmul == 2 * macs
    assert t.forward.other == (c.batch * c.c_out * h_out * w_out if c.bias else 0)
    # grad_input and grad_weight each pair every (input, kernel tap, output) triple once: the
    # forward's multiply-add count each, groups included
    assert t.backward.matmul == 2 * 2 * macs


def test_grouped_conv_weight_grad_hand_count():
    # depthwise-style: C_in = C_out = 4, groups = 4, 3×3 kernel, padding 1, x (2, 4, 5, 5) -> (2, 4, 5, 5)
    # weight (4, 1, 3, 3): 36 elements; each output element takes 1·3·3 = 9 multiply-adds
    # forward:      2 · (2·4·5·5 outputs) · 9      = 3,600
    # grad_weight:  each of the 36 weight elements sums over N·Ho·Wo = 50 products: 2 · 36 · 50 = 3,600
    # (no grad_input: the input does not require grad)
    conv = on_meta(nn.Conv2d, 4, 4, 3, padding=1, groups=4, bias=False)
    t = profile_meta(conv, (meta_input(2, 4, 5, 5),)).accounting.totals
    assert t.forward.matmul == 3_600
    assert t.backward.matmul == 3_600
    # torch.utils.flop_counter (before pytorch/pytorch#183405) says 4 × 3,600 = 14,400 here: its
    # channel-swapped grad_weight formula loses the group division, which is why the
    # FlopCounterMode comparisons below leave grouped convolutions' backward out


@given(matmul_shapes(), st.integers(1, 3))
def test_linear_backward_is_twice_forward(meta, shape, lead):
    # dX = dY Wᵀ and dW = dYᵀ X are each the forward's multiply-add count
    m, k, n = shape
    lin = meta(nn.Linear, k, n, bias=False)
    p = profile_meta(lin, (meta_input(lead, m, k),), input_requires_grad=True)
    t = p.accounting.totals
    assert t.forward.matmul > 0
    assert t.backward.matmul == 2 * t.forward.matmul


# ---------------------------------------------------------------- linear in batch
@given(mlp_stacks(), st.integers(1, 4))
def test_mlp_flops_linear_in_batch(stack, b):
    model = on_meta(stack.build)
    one = profile_meta(model, (meta_input(b, stack.widths[0]),)).accounting.totals
    two = profile_meta(model, (meta_input(2 * b, stack.widths[0]),)).accounting.totals
    assert model_flops(two.forward) == 2 * model_flops(one.forward)
    assert model_flops(two.backward) == 2 * model_flops(one.backward)


@pytest.mark.slow  # conv stacks traced per example; test_mlp_flops_linear_in_batch stays fast
@given(conv_stacks(), st.integers(2, 3))  # BatchNorm needs > 1 value per channel: batch ≥ 2
def test_conv_flops_linear_in_batch(stack, b):
    model = on_meta(stack.build)
    one = profile_meta(model, (meta_input(b, stack.in_channels, stack.size, stack.size),)).accounting.totals
    two = profile_meta(model, (meta_input(2 * b, stack.in_channels, stack.size, stack.size),)).accounting.totals
    assert two.forward.matmul == 2 * one.forward.matmul
    assert two.backward.matmul == 2 * one.backward.matmul


@pytest.mark.parametrize("name", ["GPT", "TransformerLM"])
def test_attention_flops_linear_in_batch(name):
    one = fxacct.profile(config(name, batch=1)).accounting.totals
    two = fxacct.profile(config(name, batch=2)).accounting.totals
    for cls in ("matmul", "attention"):
        assert getattr(two.forward, cls) == 2 * getattr(one.forward, cls)
        assert getattr(two.backward, cls) == 2 * getattr(one.backward, cls)
    if name == "GPT":  # fused SDPA is costed in the attention class
        assert one.forward.attention > 0


# ---------------------------------------------------------------- rows against independent figures
# The totals are the sums of the rows by definition (fxacct.account.accounting), so the rows are
# held against figures computed without fxacct: forward FLOPs per module from FlopCounterMode
# (inclusive, as fxacct's module rows are), per-layer closed forms for forward and backward, and the
# storages autograd saves in a real eager forward (saved_tensors_hooks).
@pytest.fixture(scope="module")
def example_profiles():
    return {name: fxacct.profile(config(name, batch=2)) for name in SMALL_EXAMPLES}


def _check_rows(p: fxacct.Profile, meta_model, args, kwargs=None, real=None, real_args=()):
    acc = p.accounting
    for r in acc.nodes:
        if r.kind == "view":
            assert r.output_bytes == 0, r
            assert r.forward.total == 0, r
    called = flop_counter_forward_by_module(meta_model, args, kwargs)
    modules = dict(meta_model.named_modules())
    for m in acc.modules:
        if m.module in called:
            assert model_flops(m.forward) == called[m.module], m
        else:  # a container that never runs (ModuleList) or a module FlopCounterMode saw no matmul in
            assert isinstance(modules[m.module], (nn.ModuleList, nn.ModuleDict)) or model_flops(m.forward) == 0, m
    if real is not None:  # no loss-phase saves here (the loss sums fp32 outputs): rows hold them all
        assert sum(r.activation_bytes for r in acc.nodes) == eager_saved_bytes(real, real_args)[0]


@pytest.mark.parametrize("name", list(SMALL_EXAMPLES))
def test_rows_match_independent_figures_examples(example_profiles, name):
    p = example_profiles[name]
    assert any(r.kind == "view" for r in p.accounting.nodes) or name in ("TwoLayer", "DeepLinearModel")
    model, args, kwargs = load(p.config)
    rel, ctor = SMALL_EXAMPLES[name]
    real, real_args, real_kwargs = real_model(rel, ctor, 2)
    assert not real_kwargs
    _check_rows(p, model, args, kwargs, real, real_args)


def _real_copy(stack):
    torch.manual_seed(0)
    return stack.build()


@given(mlp_stacks(), st.integers(1, 3))
def test_rows_match_closed_forms_mlp(stack, b):
    # a 3-d input: Linear folds (b, 2, k) into (2b, k) through views
    model = on_meta(stack.build)
    x = meta_input(b, 2, stack.widths[0])
    p = profile_meta(model, (x,))
    _check_rows(p, model, (x,), real=_real_copy(stack), real_args=(torch.randn(b, 2, stack.widths[0]),))
    # per Linear (module "2i"): forward 2·(2b)·k·n; backward dW, plus dX for every layer but the first
    rows = {m.module: m for m in p.accounting.modules}
    for i, (k, n) in enumerate(zip(stack.widths, stack.widths[1:])):
        fwd = 2 * (2 * b) * k * n
        row = rows[str(2 * i)]
        assert (model_flops(row.forward), model_flops(row.backward)) == (fwd, fwd * (2 if i else 1)), (i, row)


@pytest.mark.slow  # conv stacks traced per example; test_rows_match_closed_forms_mlp stays fast
@given(conv_stacks(), st.integers(2, 3), st.booleans())
def test_rows_match_closed_forms_conv(stack, b, input_grad):
    model = on_meta(stack.build)
    x = meta_input(b, stack.in_channels, stack.size, stack.size)
    p = profile_meta(model, (x,), input_requires_grad=input_grad)
    real_x = torch.randn(b, stack.in_channels, stack.size, stack.size, requires_grad=input_grad)
    _check_rows(p, model, (x,), real=_real_copy(stack), real_args=(real_x,))
    # per Conv2d: N·C_out·H_out·W_out·(C_in/groups)·k² multiply-adds (conv_stack_flops, layer by layer)
    rows = {m.module: m for m in p.accounting.modules}
    per_layer = 3 if stack.batch_norm else 2  # Conv2d, [BatchNorm2d,] activation
    size = stack.size
    for i, c in enumerate(stack.layers):
        size = (size + 2 * c.padding - c.kernel) // c.stride + 1
        fwd = 2 * b * c.c_out * size * size * (c.c_in // c.groups) * c.kernel ** 2
        row = rows[str(per_layer * i)]
        assert row.forward.matmul == fwd, (i, row)
        assert row.backward.matmul == fwd * (2 if i > 0 or input_grad else 1), (i, row)


# ---------------------------------------------------------------- agreement with FlopCounterMode
@given(mlp_stacks(), st.integers(1, 3), st.booleans())
def test_mlp_stack_matches_flop_counter(stack, b, input_grad):
    model = on_meta(stack.build)
    x = meta_input(b, stack.widths[0])
    t = profile_meta(model, (x,), input_requires_grad=input_grad).accounting.totals
    assert (model_flops(t.forward), model_flops(t.backward)) == flop_counter_oracle(model, (x,), input_grads=input_grad)


def conv_stack_flops(stack, batch: int, input_grad: bool) -> tuple[int, int]:
    """(forward, backward) matmul FLOPs of a conv stack by the closed form: each layer's
    multiply-adds are N·C_out·H_out·W_out·(C_in/groups)·k², once forward, once for grad_weight and
    once for grad_input (every layer but the first, whose input needs a grad only on request)."""
    forward = backward = 0
    size = stack.size
    for i, c in enumerate(stack.layers):
        size = (size + 2 * c.padding - c.kernel) // c.stride + 1
        macs = batch * c.c_out * size * size * (c.c_in // c.groups) * c.kernel ** 2
        forward += 2 * macs
        backward += 2 * macs * (2 if i > 0 or input_grad else 1)
    return forward, backward


@given(conv_stacks(), st.integers(2, 3), st.booleans())  # batch ≥ 2 for BatchNorm
def test_conv_stack_closed_form(stack, b, input_grad):
    model = on_meta(stack.build)
    x = meta_input(b, stack.in_channels, stack.size, stack.size)
    t = profile_meta(model, (x,), input_requires_grad=input_grad).accounting.totals
    assert (t.forward.matmul, t.backward.matmul) == conv_stack_flops(stack, b, input_grad)


@given(conv_stacks(), st.integers(2, 3), st.booleans())  # batch ≥ 2 for BatchNorm
def test_conv_stack_matches_flop_counter(stack, b, input_grad):
    model = on_meta(stack.build)
    x = meta_input(b, stack.in_channels, stack.size, stack.size)
    t = profile_meta(model, (x,), input_requires_grad=input_grad).accounting.totals
    fwd, bwd = flop_counter_oracle(model, (x,), input_grads=input_grad)
    assert model_flops(t.forward) == fwd
    if all(c.groups == 1 for c in stack.layers):  # see test_grouped_conv_weight_grad_hand_count
        assert model_flops(t.backward) == bwd
