"""Hypothesis properties of the memory account: closed forms and invariants that hold for every
model, batch and precision drawn.

Expected values are computed from the drawn sizes (closed forms), measured on a real eager run of
the same model (saved_tensors_hooks for activations, fxacct.runtime.storage_tracker for peaks), or
are relations between profiles of the same model (affinity in the batch), never read back from
fxacct.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
import torch
from helpers import SMALL_EXAMPLES, config, eager_saved_bytes, meta_input, on_meta, profile_meta, target
from hypothesis import given, settings
from strategies import ACTIVATIONS, MLPStack

import fxacct
from fxacct.runtime.storage_tracker import measure_inference, measure_training_step

PRECISIONS = {"fp32": {}, "bf16": {"dtype": torch.bfloat16}, "amp-bf16": {"amp": torch.bfloat16}}
# ResNet18 ends at 1x1 spatial: BatchNorm in training needs batch >= 2 there
MIN_BATCH = {"ResNet18": 2}
CHEAP = ["TwoLayer", "DeepLinearModel", "MLP", "GPT", "TransformerLM"]


@functools.cache
def profiled(name: str, batch: int, precision: str = "fp32", optimizer: str = "adamw",
             shard: str = "none", world_size: int = 1) -> fxacct.Profile:
    return fxacct.profile(config(name, batch=batch, optimizer=optimizer, shard=shard, world_size=world_size,
                                 **PRECISIONS[precision]))


@st.composite
def example_at_batch(draw, names=tuple(SMALL_EXAMPLES), max_batch: int = 3):
    name = draw(st.sampled_from(names))
    return name, draw(st.integers(MIN_BATCH.get(name, 1), max_batch))


# --------------------------------------------------------------------------------------------------
# Parameter bytes follow the width exactly
# --------------------------------------------------------------------------------------------------

@pytest.mark.slow  # a real step per drawn stack; test_views_never_add_bytes stays fast
@settings(max_examples=15)
@given(d_model=st.integers(1, 48), d_hidden=st.integers(1, 48), n_blocks=st.integers(1, 3),
       batch=st.integers(1, 3))
def test_mlp_param_bytes_closed_form(d_model, d_hidden, n_blocks, batch):
    # examples/mlp.py: per block LayerNorm(d) 2d + fc1 d·h + h + fc2 h·d + d; final LayerNorm 2d
    params = n_blocks * (2 * d_model + d_model * d_hidden + d_hidden + d_hidden * d_model + d_model) + 2 * d_model
    p = fxacct.profile(fxacct.Config(target=target("examples/mlp.py:MLP"), batch=batch, optimizer="none",
                                     kwargs=dict(d_model=d_model, d_hidden=d_hidden, n_blocks=n_blocks)))
    assert p.memory.param_bytes == 4 * params
    assert p.memory.by_dtype["float32"].param_bytes == 4 * params
    assert p.memory.grad_bytes == 4 * params  # every parameter reaches the loss
    assert p.memory.optimizer_bytes == 0


# --------------------------------------------------------------------------------------------------
# Saved activations are affine in the batch
# --------------------------------------------------------------------------------------------------

@pytest.mark.slow  # three traces per drawn model; the other properties stay fast
@settings(max_examples=10)
@given(example_at_batch(names=tuple(CHEAP) + ("ResNet18",), max_batch=2),
       st.sampled_from(list(PRECISIONS)))
def test_activation_bytes_affine_in_batch(case, precision):
    # f(b) = a·b + c: three batches b, 2b, 3b determine a and c twice over. c collects what does not
    # scale (BatchNorm's per-channel saved mean and inverse std, GPT's position indices).
    name, b = case
    f = [profiled(name, k * b, precision).memory for k in (1, 2, 3)]
    y1, y2, y3 = (m.activation_bytes for m in f)
    a, rem = divmod(y2 - y1, b)
    assert rem == 0, (name, b, y1, y2)
    c = y1 - a * b
    assert a > 0 and c >= 0
    assert y3 == 3 * a * b + c, (name, b, precision, y1, y2, y3)
    dtypes = set().union(*(m.by_dtype for m in f))
    for dt in dtypes:
        y1, y2, y3 = (m.by_dtype[dt].activation_bytes if dt in m.by_dtype else 0 for m in f)
        assert y3 - y2 == y2 - y1, (name, b, precision, dt, y1, y2, y3)


# --------------------------------------------------------------------------------------------------
# Views never add bytes
# --------------------------------------------------------------------------------------------------

@settings(max_examples=12)
@given(example_at_batch(), st.sampled_from(list(PRECISIONS)))
def test_views_never_add_bytes(case, precision):
    # which nodes are views is checked against FakeTensor storage identity in test_aliasing.py
    name, b = case
    p = profiled(name, b, precision)
    views = [r for r in p.accounting.nodes if r.kind == "view"]
    for r in views:
        assert r.output_bytes == 0, r
        assert r.activation_bytes == 0, r  # a saved view is counted on the node that allocated its storage


# --------------------------------------------------------------------------------------------------
# Drawn models: every byte figure against a closed form or a real eager step
# --------------------------------------------------------------------------------------------------

class NoOptimizer:
    """`--optimizer none` in a real step: nothing to step, gradients dropped between steps."""

    def __init__(self, params):
        self.params = list(params)

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


# name -> (fxacct --optimizer, --optim-arg, real optimizer factory, state bytes as a closed form of
# (P parameters, T parameter tensors, s bytes per element)); every state tensor has the parameter's
# dtype except the 0-dim fp32 `step` per tensor (torch.optim's _get_scalar_dtype)
OPTIMIZER_FORMS = {
    "none": ("none", {}, NoOptimizer, lambda P, T, s: 0),
    "sgd": ("sgd", {}, lambda ps: torch.optim.SGD(ps, lr=0.1), lambda P, T, s: 0),
    "sgd-momentum": ("sgd", {"momentum": 0.9}, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                     lambda P, T, s: P * s),  # momentum_buffer
    "adamw": ("adamw", {}, torch.optim.AdamW, lambda P, T, s: 2 * P * s + 4 * T),  # exp_avg, exp_avg_sq, step
    "adagrad": ("adagrad", {}, torch.optim.Adagrad, lambda P, T, s: P * s + 4 * T),  # sum, step
}


@dataclass(frozen=True)
class MemoryCase:
    stack: MLPStack
    dtype: torch.dtype
    optimizer: str
    batch: int

    @property
    def params(self) -> int:  # P: k·n weights (+ n biases) per Linear
        return sum(k * n + (n if self.stack.bias else 0) for k, n in zip(self.stack.widths, self.stack.widths[1:]))

    @property
    def tensors(self) -> int:  # T: a weight (and a bias) per Linear
        return (len(self.stack.widths) - 1) * (2 if self.stack.bias else 1)

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()


@st.composite
def memory_cases(draw):
    """A Linear stack of drawn widths and depth (1-3 layers), activation and bias; a dtype; an
    optimizer; a batch."""
    widths = tuple(draw(st.lists(st.integers(1, 16), min_size=2, max_size=4)))
    stack = MLPStack(widths, draw(st.sampled_from(ACTIVATIONS)), draw(st.booleans()))
    return MemoryCase(stack, draw(st.sampled_from([torch.float32, torch.bfloat16])),
                      draw(st.sampled_from(list(OPTIMIZER_FORMS))), draw(st.integers(1, 4)))


def _profile_case(case: MemoryCase, **config) -> fxacct.Profile:
    name, args, _, _ = OPTIMIZER_FORMS[case.optimizer]
    model = on_meta(case.stack.build)
    dtype = None if case.dtype == torch.float32 else case.dtype
    return profile_meta(model, (meta_input(case.batch, case.stack.widths[0]),), dtype=dtype, optimizer=name,
                        optim_args=dict(args), **config)


@pytest.mark.slow  # 12 drawn models, each also run for real
@settings(max_examples=12, deadline=None)
@given(memory_cases())
def test_drawn_models_match_closed_forms_and_a_real_step(case):
    p = _profile_case(case)
    m = p.memory
    P, T, s = case.params, case.tensors, case.itemsize
    state = OPTIMIZER_FORMS[case.optimizer][3](P, T, s)
    # closed forms: every parameter reaches the loss, so every one gets a gradient
    assert (m.param_bytes, m.grad_bytes, m.optimizer_bytes) == (P * s, P * s, state)
    # the real model: same shapes and dtype, real weights
    torch.manual_seed(0)
    real = case.stack.build().to(case.dtype)
    x = torch.randn(case.batch, case.stack.widths[0]).to(case.dtype)
    total, by = eager_saved_bytes(real, (x,))
    assert m.activation_bytes == total
    assert {k: v.activation_bytes for k, v in m.by_dtype.items() if v.activation_bytes} == by
    train = measure_training_step(real, (x,), OPTIMIZER_FORMS[case.optimizer][2])
    real.zero_grad(set_to_none=True)
    infer = measure_inference(real, (x,))
    assert train.adopted_bytes == infer.adopted_bytes == 0  # the tracker saw every storage
    assert m.peak_train.bytes == train.peak_bytes
    assert m.peak_inference.bytes == infer.peak_bytes
    # composition at the peaks: what is resident all step is there in full; inference holds no
    # gradients and no optimizer state
    assert m.peak_train.category("parameters") == m.peak_inference.category("parameters") == P * s
    assert m.peak_train.category("optimizer_state") == state
    assert m.peak_train.category("gradients") <= P * s
    assert m.peak_inference.category("gradients") == m.peak_inference.category("optimizer_state") == 0


@settings(max_examples=10, deadline=None)
@given(memory_cases().filter(lambda c: c.optimizer in ("adamw", "adagrad", "sgd-momentum")),
       st.sampled_from(["zero1", "zero2", "zero3", "fsdp"]), st.integers(2, 8))
def test_sharded_optimizer_state_per_rank(case, shard, world_size):
    # every ZeRO stage and FSDP partition the optimizer state: each state tensor's bytes over the
    # ranks, rounded up (a rank holds at most that much); the per-element tensors have the
    # parameter's shape, the `step` counts 4 B each
    p = _profile_case(case, shard=shard, world_size=world_size)
    shapes = [(k * n, n if case.stack.bias else None) for k, n in zip(case.stack.widths, case.stack.widths[1:])]
    numels = [x for pair in shapes for x in pair if x is not None]
    per_element = {"adamw": 2, "adagrad": 1, "sgd-momentum": 1}[case.optimizer]
    steps = 0 if case.optimizer == "sgd-momentum" else 1
    ceil = lambda b: -(-b // world_size)  # noqa: E731
    expected = sum(per_element * ceil(n * case.itemsize) + steps * ceil(4) for n in numels)
    assert p.memory.per_rank.category("optimizer_state") == expected
    # the state is resident all step, so a rank saves its unsharded part at every instant; ZeRO-3 and
    # FSDP hold the largest gathered unit besides their shards (a one-tensor model: its whole weight)
    unsharded = p.memory.peak_train.category("optimizer_state")
    gathered = p.memory.gathered_unit[1] if shard in ("zero3", "fsdp") else 0
    assert (shard in ("zero3", "fsdp")) == (p.memory.gathered_unit is not None)
    assert p.memory.per_rank.bytes <= p.memory.peak_train.bytes - (unsharded - expected) + gathered
    assert unsharded > expected
