"""A capture read for its peak alone (a profile's inference forward) keeps its ops as records, not
graph nodes (CaptureOptions.nodes False). Its lifetimes must be exactly the graph's: the same
storages born and dying at the same ops, the same residents, and each op the name fx gives its node
(the inference peak's ``node``), here on ops that make several outputs, a constant the fake mode
lifts, replayed blocks, and a rank of an FSDP2 + TP mesh whose collectives' waits alias buffers."""

from __future__ import annotations

import operator

import pytest
import torch
from helpers import target
from torch import nn

import fxacct
import fxacct.step
from fxacct.memory.peak import lifetimes
from fxacct.trace.capture import CaptureOptions, capture


class ManyOutputs(nn.Module):
    """max/topk/sort return several tensors (getitem nodes in the graph); split returns views;
    torch.tensor in forward is a constant the fake mode lifts (lift_fresh_copy)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        values, indices = h.max(dim=-1)
        top, _ = torch.topk(h, 4)
        ordered, order = torch.sort(h, dim=-1)
        a, b = h.split(8, dim=-1)
        scale = torch.tensor(2.0)
        return (a * b).sum() * scale + values.sum() + top.sum() + ordered[..., 0].sum() + indices.sum() + order.sum()


class Blocks(nn.Module):
    """Four identical blocks: the inference capture replays two of them from a proven template."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


@pytest.mark.parametrize("model", [ManyOutputs(), Blocks()], ids=["many outputs", "blocks"])
def test_the_lifetimes_without_nodes_are_the_graphs(model):
    x = torch.randn(4, 16, device="meta")
    with_nodes = capture(model, (x,), {}, CaptureOptions(inference=True))
    without = capture(model, (x,), {}, CaptureOptions(inference=True, nodes=False))
    assert without.ops is not None and with_nodes.ops is None
    assert not [n for n in without.graph.nodes if n.op != "placeholder"]  # no op node made
    ops = [n for n in with_nodes.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert without.ops.names == tuple(n.name for n in ops)
    if isinstance(model, ManyOutputs):  # the cases this model is for
        assert any(n.target is operator.getitem for n in with_nodes.graph.nodes)
        assert without.ops.constant_users, "no lifted constant"
    assert lifetimes(without) == lifetimes(with_nodes)


def test_a_training_steps_lifetimes_without_nodes_are_the_graphs():
    """Forward, backward and optimizer ops: their phases and the first cuBLAS op of each thread."""
    from fxacct.load.specs import OptimizerSpec

    model, x = Blocks(), torch.randn(4, 16, device="meta")
    with_nodes = capture(model, (x,), {}, CaptureOptions(optimizer=OptimizerSpec("adamw")))
    without = capture(model, (x,), {}, CaptureOptions(optimizer=OptimizerSpec("adamw"), nodes=False))
    life = lifetimes(without)
    assert {"forward", "backward", "optimizer"} <= set(life.op_phases)
    assert life.first_cublas_ops[0] is not None and life.first_cublas_ops[1] is not None
    assert life == lifetimes(with_nodes)


def test_a_mesh_ranks_inference_peak_is_the_graphs(monkeypatch):
    """fsdp=2,tp=2 on examples/llama.py: the inference forward gathers each block's parameters
    (functional collectives whose waits alias their buffers: fxacct.parallel.collectives.alias_waits)."""
    config = fxacct.Config(target=target("examples/llama.py:Llama"), batch=2, mesh="fsdp=2,tp=2",
                           parallelize=target("examples/llama.py:parallelize"))
    without = fxacct.profile(config).memory.peak_inference
    options = fxacct.step.capture_options
    monkeypatch.setattr(fxacct.step, "capture_options",
                        lambda *a, **kw: options(*a, **{k: v for k, v in kw.items() if k != "nodes"}))
    with_nodes = fxacct.profile(config).memory.peak_inference
    assert without == with_nodes
    assert without.category("temporaries") > 0  # gathered weights and activations, not only residents
