"""--mesh memory: FSDP2's per-rank parameter, gradient and optimizer bytes (dim-0 padding
included) in closed form, agreement with the --world-size/--shard arithmetic where both apply,
and the per-rank peak against an eager run's storage tracker on rank 0."""

from __future__ import annotations

import pytest
import torch

import fxacct
from helpers import target
from parallel_oracle import eager_peak, load

LLAMA = "examples/llama.py:Llama"
GPT = "examples/gpt2.py:GPT"
GPT_KW = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1001, block_size=32)


def _profile(rel, mesh=None, parallelize=None, **kw):
    return fxacct.profile(fxacct.Config(target=target(rel), batch=2, mesh=mesh,
                                        parallelize=target(parallelize) if parallelize else None, **kw))


def test_fsdp2_bytes_with_dim0_padding():
    """FSDP2 shards every parameter on dim 0 into N chunks padded to ceil(d0/N) rows; rank 0 holds
    a full chunk: ceil(d0/N)·(numel/d0)·4 B in fp32. GPT's vocab 1001 at N=4: the (tied) token
    embedding is 251 rows, not 250.25. Gradients: the same shards. AdamW: exp_avg and exp_avg_sq
    per shard (2×) plus one 4-byte step tensor per parameter, unsharded, on every rank."""
    n = 4
    with torch.device("meta"):
        model = load(GPT)(**GPT_KW)
    params = list(model.parameters())  # tied weights once
    shard = sum(-(-p.shape[0] // n) * (p.numel() // p.shape[0]) * 4 for p in params)
    p = _profile(GPT, "fsdp=4", kwargs=dict(GPT_KW))
    t = p.accounting.totals
    assert t.param_bytes == shard
    assert t.grad_bytes == shard
    assert p.memory.optimizer_bytes == 2 * shard + 4 * len(params)
    assert p.memory.optimizer_scalars == (len(params), 4 * len(params))


def test_mesh_fsdp_agrees_with_the_shard_arithmetic():
    """Llama's dims all divide by 4 (no padding): --mesh fsdp=4 holds exactly 1/4 of every
    parameter, gradient and optimizer buffer, what --world-size 4 --shard fsdp computes; they
    differ only in AdamW's step scalars, which the arithmetic shards (ceil(4/4) = 1 B each) and
    FSDP2 keeps whole (4 B each, 21 parameters)."""
    old = _profile(LLAMA, world_size=4, shard="fsdp")
    new = _profile(LLAMA, "fsdp=4")
    assert new.accounting.totals.param_bytes == old.accounting.totals.param_bytes // 4
    assert new.accounting.totals.grad_bytes == old.accounting.totals.grad_bytes // 4
    old_state = dict(old.memory.per_rank.by_category)["optimizer_state"]
    scalars = old.memory.optimizer_scalars[0]
    assert scalars == 21
    assert new.memory.optimizer_bytes - 4 * scalars == old_state - 1 * scalars
    assert dict(old.memory.per_rank.by_category)["parameters"] - old.memory.gathered_unit[1] == \
        new.accounting.totals.param_bytes


@pytest.mark.parametrize("dims,par", [
    ({"fsdp": 2}, "examples/llama.py:parallelize"),
    ({"tp": 2}, "examples/llama.py:parallelize"),
    ({"fsdp": 2, "tp": 2}, "examples/llama.py:parallelize"),
])
def test_rank_peak_matches_the_storage_tracker(dims, par):
    mesh = ",".join(f"{k}={v}" for k, v in dims.items())
    predicted = _profile(LLAMA, mesh, par).memory.peak_train.bytes
    measured = eager_peak(lambda: load(LLAMA)(), load(par), dims, (torch.randint(0, 512, (2, 64)),))
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def test_fsdp_activations_are_the_single_device_ones():
    """FSDP2 changes where parameters live, not what autograd saves of the activations: the saved
    unsharded weights are parameters FSDP2 frees and gathers again, so a rank's activation bytes
    at the same per-rank batch equal the single-device account's (itself checked against
    saved_tensors_hooks in tests/test_memory_acceptance.py)."""
    single = _profile(LLAMA).accounting.totals.activation_bytes
    assert _profile(LLAMA, "fsdp=4").accounting.totals.activation_bytes == single
