"""Acceptance numbers from the Stanford CS336 resource-accounting lecture, counted by hand.

Convention: 2 FLOPs per multiply-add (DESIGN.md), so (m, k) @ (k, n) costs 2·m·k·n.
"""

import pytest
from helpers import target

import fxacct
from fxacct.costs.matmul import mm_flops


def _profile(rel: str, **config) -> fxacct.Profile:
    return fxacct.profile(fxacct.Config(target=target(rel), batch=2, **config))


@pytest.fixture(scope="module")
def two_layer():
    return _profile("examples/two_layer.py:TwoLayer")


@pytest.fixture(scope="module")
def deep_linear():
    return _profile("examples/deep_linear.py:DeepLinearModel")


def test_mm_flops_lecture_example():
    # (256, 512) @ (512, 256): 2 · 256 · 512 · 256 = 67,108,864
    assert mm_flops((256, 512), (512, 256)) == 67_108_864


def test_two_layer_forward(two_layer):
    # x (2,3) @ w1 (3,3): 2·2·3·3 = 36; h1 (2,3) @ w2 (3,2): 2·2·3·2 = 24; total 60
    f = two_layer.accounting.totals.forward
    assert (f.matmul, f.attention, f.other) == (60, 0, 0)
    assert [r.forward.matmul for r in two_layer.accounting.nodes if r.op == "aten.mm.default"] == [36, 24]


def test_two_layer_backward_without_input_grad(two_layer):
    # layer 2: dW2 = h1ᵀ (3,2) @ dy (2,2): 2·3·2·2 = 24; dh1 = dy (2,2) @ w2ᵀ (2,3): 2·2·2·3 = 24
    # layer 1: dW1 = xᵀ (3,2) @ dh1 (2,3): 2·3·2·3 = 36; dx not needed
    # 24 + 24 + 36 = 84
    b = two_layer.accounting.totals.backward
    assert (b.matmul, b.attention, b.other) == (84, 0, 0)


def test_two_layer_backward_with_input_grad():
    # 84 + dx = dh1 (2,3) @ w1ᵀ (3,3): 2·2·3·3 = 36  ->  120 (= 2 × forward)
    p = _profile("examples/two_layer.py:TwoLayer", input_requires_grad=True)
    assert p.accounting.totals.backward.matmul == 120
    assert p.accounting.totals.forward.matmul == 60


def test_two_layer_params(two_layer):
    # w1 3·3 + w2 3·2 = 15
    assert two_layer.accounting.totals.params == 15


def test_deep_linear_forward(deep_linear):
    # four (2,3) @ (3,3) products: 4 · 2·2·3·3 = 144; the bias add: 2×3 = 6 elements, 1 FLOP each
    f = deep_linear.accounting.totals.forward
    assert (f.matmul, f.attention, f.other) == (144, 0, 6)


def test_deep_linear_backward(deep_linear):
    # each layer's dW = (3,2) @ (2,3): 36, four of them = 144; dx for the three inner layers
    # (the first layer's input needs no grad): 3 · 36 = 108; 144 + 108 = 252
    assert deep_linear.accounting.totals.backward.matmul == 252


def test_deep_linear_params(deep_linear):
    # 4 · 3·3 weights + 3 bias = 39
    t = deep_linear.accounting.totals
    assert t.params == 39
    assert t.trainable_params == 39
    assert t.param_bytes == 39 * 4  # float32
