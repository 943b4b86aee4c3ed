"""Hypothesis strategies: small, mutually consistent shapes for single ops and model stacks.

Sizes stay small (a trace costs milliseconds per op); every strategy returns plain ints/tuples so
the expected values can be computed from them by closed forms in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import torch.nn as nn

ACTIVATIONS = ("relu", "gelu", "tanh", "sigmoid", "silu", "none")


def activation(name: str) -> nn.Module:
    return {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid,
            "silu": nn.SiLU, "none": nn.Identity}[name]()


@st.composite
def matmul_shapes(draw, max_dim: int = 9):
    """(m, k, n) for (m, k) @ (k, n)."""
    d = st.integers(1, max_dim)
    return draw(d), draw(d), draw(d)


@st.composite
def bmm_shapes(draw, max_batch: int = 4, max_dim: int = 8):
    """(b, m, k, n) for (b, m, k) @ (b, k, n)."""
    d = st.integers(1, max_dim)
    return draw(st.integers(1, max_batch)), draw(d), draw(d), draw(d)


@dataclass(frozen=True)
class Conv2dCase:
    batch: int
    c_in: int
    c_out: int
    kernel: tuple[int, int]
    stride: int
    padding: int
    groups: int
    height: int
    width: int
    bias: bool

    @property
    def out_hw(self) -> tuple[int, int]:
        # H_out = floor((H + 2p - k) / s) + 1 (no dilation), torch.nn.Conv2d's shape formula
        return tuple((size + 2 * self.padding - k) // self.stride + 1
                     for size, k in zip((self.height, self.width), self.kernel))


@st.composite
def conv2d_configs(draw, max_channels_per_group: int = 4, max_groups: int = 3):
    """A valid Conv2d: groups divide both channel counts, spatial size ≥ kernel."""
    groups = draw(st.integers(1, max_groups))
    c_in = groups * draw(st.integers(1, max_channels_per_group))
    c_out = groups * draw(st.integers(1, max_channels_per_group))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride = draw(st.integers(1, 2))
    padding = draw(st.integers(0, 1))
    height = draw(st.integers(kh, 8))
    width = draw(st.integers(kw, 8))
    return Conv2dCase(draw(st.integers(1, 3)), c_in, c_out, (kh, kw), stride, padding, groups,
                      height, width, draw(st.booleans()))


@dataclass(frozen=True)
class MLPStack:
    widths: tuple[int, ...]  # widths[0] is the input width; one Linear per consecutive pair
    activation: str
    bias: bool

    def build(self) -> nn.Sequential:
        layers = []
        for d_in, d_out in zip(self.widths, self.widths[1:]):
            layers += [nn.Linear(d_in, d_out, bias=self.bias), activation(self.activation)]
        return nn.Sequential(*layers)


@st.composite
def mlp_stacks(draw, max_layers: int = 4, max_width: int = 12):
    widths = tuple(draw(st.lists(st.integers(1, max_width), min_size=2, max_size=max_layers + 1)))
    return MLPStack(widths, draw(st.sampled_from(ACTIVATIONS)), draw(st.booleans()))


@dataclass(frozen=True)
class ConvLayer:
    c_in: int
    c_out: int
    kernel: int
    stride: int
    padding: int
    groups: int
    bias: bool


@dataclass(frozen=True)
class ConvStack:
    in_channels: int
    size: int  # square input, size × size
    layers: tuple[ConvLayer, ...]
    activation: str
    batch_norm: bool

    def build(self) -> nn.Sequential:
        modules = []
        for c in self.layers:
            modules.append(nn.Conv2d(c.c_in, c.c_out, c.kernel, c.stride, c.padding,
                                     groups=c.groups, bias=c.bias))
            if self.batch_norm:
                modules.append(nn.BatchNorm2d(c.c_out))
            modules.append(activation(self.activation))
        return nn.Sequential(*modules)


@st.composite
def conv_stacks(draw, max_layers: int = 3):
    """Chained Conv2d layers: each layer's c_in is the previous c_out and each layer's kernel fits
    the spatial size left by the layers before it (tracked with the Conv2d shape formula)."""
    in_size = size = draw(st.integers(4, 10))
    in_channels = channels = draw(st.integers(1, 4))
    layers = []
    for _ in range(draw(st.integers(1, max_layers))):
        # kernel ≤ size keeps the next size (size + 2p - k) // s + 1 ≥ 1
        kernel = draw(st.integers(1, min(3, size)))
        padding = draw(st.integers(0, kernel // 2))
        stride = draw(st.integers(1, 2))
        groups = draw(st.sampled_from([g for g in range(1, channels + 1) if channels % g == 0]))
        c_out = groups * draw(st.integers(1, 3))
        layers.append(ConvLayer(channels, c_out, kernel, stride, padding, groups, draw(st.booleans())))
        channels = c_out
        size = (size + 2 * padding - kernel) // stride + 1
    return ConvStack(in_channels, in_size, tuple(layers), draw(st.sampled_from(ACTIVATIONS)),
                     draw(st.booleans()))
