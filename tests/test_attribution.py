"""One attribution: the owner of every backward op (the forward node its FLOPs and time belong to)
is decided once, in fxacct.account.annotate, and the accounting table, the roofline prediction and
the runtime comparison all read it.

Each view sums backward FLOPs per forward node its own way: the accounting from its rows, the
roofline from its per-op times (OpTime.owner), the runtime comparison from its node rows. If any
of them derived the owner again (three copies once did, and disagreed on 2 to 34 nodes per
example), the per-node figures would differ here.
"""

from __future__ import annotations

import operator

import pytest
import torch
from helpers import SMALL_EXAMPLES, config

import fxacct
from fxacct.devices import DEVICES
from fxacct.predict.fused_time import predict_profile
from fxacct.predict.roofline import from_gpu
from fxacct.runtime import RuntimeOptions
from fxacct.runtime import run as runtime_run

H100 = from_gpu(DEVICES["h100"])


def _accounting_backward(p) -> dict[str, int]:
    return {r.name: r.backward.total for r in p.accounting.nodes}


def _roofline_backward(p) -> dict[str, int]:
    prediction = predict_profile(p, H100)
    recompute = {n.name for n in p.capture.graph.nodes if "fxacct" in n.meta and n.meta["fxacct"].recompute}
    out: dict[str, int] = {}
    for op in prediction.ops:
        if op.phase == "backward" and op.node not in recompute:
            out[op.owner] = out.get(op.owner, 0) + op.flops
    return out


@pytest.mark.parametrize("name", sorted(SMALL_EXAMPLES))
def test_accounting_and_roofline_attribute_every_backward_flop_to_the_same_node(name):
    p = fxacct.profile(config(name, batch=2))
    accounting = _accounting_backward(p)
    roofline = _roofline_backward(p)
    assert sum(accounting.values()) == p.accounting.totals.backward.total > 0
    # nodes that own no backward op are absent from the roofline's sums
    assert {k: v for k, v in accounting.items() if v} == {k: v for k, v in roofline.items() if v}


@pytest.mark.slow  # real runs; test_accounting_and_roofline_attribute_every_backward_flop_to_the_same_node stays fast
@pytest.mark.parametrize("name", ["TwoLayer", "MLP", "GPT"])
def test_runtime_comparison_attributes_like_the_accounting(name):
    result = runtime_run(config(name, batch=2), RuntimeOptions(device="cpu", steps=1, warmup=0))
    p = result.profile
    forward = {r.name: r.forward.total for r in p.accounting.nodes}
    compared = {row.name: row.flops - forward[row.name] for row in result.comparison.nodes}
    ops = {r.name for r in p.accounting.nodes if r.op != "input"}  # the comparison's rows are ops
    assert set(compared) == ops
    assert compared == {k: v for k, v in _accounting_backward(p).items() if k in ops}


def _accumulations(graph) -> list[torch.fx.Node]:
    """Backward adds of gradients that derive from two different forward ops."""
    out = []
    for n in graph.nodes:
        if n.target is not torch.ops.aten.add.Tensor or n.meta["fxacct"].phase != "backward":
            continue
        links = {a.meta["trace"].derived_from for a in n.all_input_nodes if a.target is not operator.getitem}
        links.discard(None)
        if len(links) > 1:
            out.append(n)
    return out


def test_tied_weight_gradient_sum_goes_to_its_last_forward_user():
    # GPT ties lm_head.weight to wte.weight: the engine sums the embedding's gradient and the
    # head's. DESIGN.md: that sum belongs to the last forward node that used the weight (the head's
    # transpose, after every block), not to the embedding where the engine happened to run it.
    p = fxacct.profile(config("GPT", batch=2))
    graph = p.capture.graph
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    (embedding,) = [n for n in graph.nodes if n.target is torch.ops.aten.embedding.default
                    and n.meta["fxacct"].phase == "forward" and n.meta["fxacct"].module == "wte"]
    sums = [n for n in _accumulations(graph) if embedding in
            {a.meta["trace"].derived_from for a in n.all_input_nodes}]
    assert sums, "the tied weight's two gradients are summed somewhere"
    for n in sums:
        owner = n.meta["fxacct"].owner
        assert owner != embedding.name
        assert order[owner] > order[embedding.name]
        # the same owner in the roofline's op list
        (op,) = [o for o in predict_profile(p, H100).ops if o.node == n.name]
        assert op.owner == owner
