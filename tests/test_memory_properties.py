"""Hypothesis properties of the memory account: closed forms and invariants that hold for every
model, batch and precision drawn.

Expected values are computed from the drawn sizes (closed forms), or are relations between
profiles of the same model (affinity in the batch), never read back from fxacct.
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

import fxacct
from fxacct.memory.peak import CATEGORIES
from helpers import SMALL_EXAMPLES, config, target

PRECISIONS = {"fp32": {}, "bf16": {"dtype": torch.bfloat16}, "amp-bf16": {"amp": torch.bfloat16}}
# ResNet18 ends at 1x1 spatial: BatchNorm in training needs batch >= 2 there
MIN_BATCH = {"ResNet18": 2}
CHEAP = ["TwoLayer", "DeepLinearModel", "MLP", "GPT", "TransformerLM"]


@functools.lru_cache(maxsize=None)
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
    name, b = case
    p = profiled(name, b, precision)
    views = [r for r in p.accounting.nodes if r.kind == "view"]
    for r in views:
        assert r.output_bytes == 0, r
        assert r.activation_bytes == 0, r  # a saved view is counted on the node that allocated its storage
    assert p.memory.views.view_nodes == len(views)


# --------------------------------------------------------------------------------------------------
# A peak's composition sums to the peak
# --------------------------------------------------------------------------------------------------

@settings(max_examples=15)
@given(example_at_batch(names=tuple(CHEAP)), st.sampled_from(list(PRECISIONS)),
       st.sampled_from(["sgd", "adamw", "adagrad", "none"]),
       st.sampled_from(["zero1", "zero2", "zero3", "fsdp"]), st.integers(2, 8))
def test_category_totals_sum_to_the_peak(case, precision, optimizer, shard, world_size):
    name, b = case
    m = profiled(name, b, precision, optimizer, shard, world_size).memory
    for peak in (m.peak_train, m.peak_inference, m.per_rank):
        assert [c for c, _ in peak.by_category] == list(CATEGORIES)
        assert all(v >= 0 for _, v in peak.by_category), peak
        assert sum(v for _, v in peak.by_category) == peak.bytes, peak
    # inference holds no gradients and no optimizer state
    assert m.peak_inference.category("gradients") == m.peak_inference.category("optimizer_state") == 0
    if optimizer == "none":
        assert m.peak_train.category("optimizer_state") == 0
