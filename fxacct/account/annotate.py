"""Annotate: one walk over the captured graph that writes node.meta["fxacct"] = NodeCost.

It reads each node's recorded output metadata (meta["val"]) instead of re-running the op in an
fx.Interpreter: the ops already ran once during capture, and running them again would double the
cost of the whole account.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxacct.trace import aliasing
from fxacct.trace.capture import TensorMeta, tensor_metas
from fxacct.costs import CostContext, Flops, lookup
from fxacct.costs.registry import ZERO


@dataclass(frozen=True)
class NodeCost:
    flops: Flops
    kind: str  # one of aliasing.KINDS
    output_bytes: int  # newly allocated bytes over all outputs (0 for views and in-place ops)
    saved_bytes: int  # bytes of this node's storages that autograd saves for backward
    saved_by_dtype: tuple[tuple[torch.dtype, int], ...]
    unsupported: bool  # no cost formula: FLOPs unknown, shown in every report


def _shape(a):
    if isinstance(a, (torch.Tensor, TensorMeta)):
        return tuple(a.shape)
    if isinstance(a, fx.Node):
        return _shape(a.meta.get("val"))
    if isinstance(a, (list, tuple)):
        return type(a)(_shape(x) for x in a)
    return a


def _has_tensor_arg(node: fx.Node) -> bool:
    return bool(node.all_input_nodes)


def _grad_mask(node: fx.Node):
    """Which tensor inputs of the forward op this backward op derives from required grad."""
    fwd = node.meta.get("fwd")
    return None if fwd is None else fwd.meta.get("args_requires_grad")


def node_cost(node: fx.Node, causal_attention: str = "full") -> NodeCost:
    op = node.target
    val = node.meta.get("val")
    saved = node.meta.get("saved", ())
    saved_bytes = sum(b for b, _ in saved)
    by_dtype: dict[torch.dtype, int] = {}
    for b, dt in saved:
        by_dtype[dt] = by_dtype.get(dt, 0) + b
    saved_pairs = tuple(by_dtype.items())
    if node.op == "placeholder":
        kind = aliasing.INPUT if node.meta.get("kind") == aliasing.INPUT else "parameter"
        return NodeCost(ZERO, kind, 0, saved_bytes, saved_pairs, False)
    kind = aliasing.op_kind(op, _has_tensor_arg(node))
    outputs = tensor_metas(val)
    new_bytes = 0 if kind in (aliasing.VIEW, aliasing.INPLACE) else sum(t.nbytes for t in outputs)
    if kind == aliasing.VIEW:
        return NodeCost(ZERO, kind, 0, saved_bytes, saved_pairs, False)
    info = lookup(op)
    if info is None:
        return NodeCost(ZERO, kind, new_bytes, saved_bytes, saved_pairs, True)
    ctx = CostContext(causal_attention, _grad_mask(node) if info.wants_grad_mask else None, op)
    out_shape = _shape(val)
    flops = info.formula(*_shape(node.args), out_shape=out_shape, ctx=ctx, **_shape(node.kwargs))
    if flops.matmul and _in_attention(node):  # SDPA's math path: its products are attention
        flops = Flops(matmul=0, attention=flops.attention + flops.matmul, other=flops.other)
    return NodeCost(flops, kind, new_bytes, saved_bytes, saved_pairs, False)


def _in_attention(node: fx.Node) -> bool:
    fwd = node.meta.get("fwd")
    return node.meta.get("scope") == "attention" or (fwd is not None and fwd.meta.get("scope") == "attention")


def annotate(graph: fx.Graph, causal_attention: str = "full") -> fx.Graph:
    """Write NodeCost into every placeholder and op node; getitem plumbing gets none."""
    for node in graph.nodes:
        if node.op == "output" or node.target is operator.getitem:
            continue
        try:
            node.meta["fxacct"] = node_cost(node, causal_attention)
        except Exception as e:  # a formula bug must name the node it failed on
            raise RuntimeError(f"costing {node.format_node()} failed: {e}") from e
    return graph
