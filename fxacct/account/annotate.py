"""Annotate: one walk over the captured graph that writes node.meta["fxacct"] = NodeCost.

It decides, once, everything later stages read of a node: its cost (FLOPs by class from the
registry, new bytes, saved bytes, view/copy/compute kind from the schema), its phase, its module
and its *owner*: the forward node its FLOPs and time belong to. Accounting, the roofline, the
runtime comparison and the reports read ``owner``; none derives it again.

Ownership (DESIGN.md): a forward node owns itself. A backward op belongs to the forward op its
autograd Node derives from (the sequence-number link of the capture); a backward op of the loss's
autograd Nodes is in the loss phase. A backward op with no forward op of its own, or the engine's
sum of the gradients of a tensor used twice (tied weights, a residual: an add whose inputs derive
from different forward ops), goes to the latest forward node among the forward links of the ops
feeding it, else to the last forward node, so per-node figures always sum to the totals. Loss and
optimizer ops have no owner.

It reads each node's recorded output metadata (meta["val"]) instead of re-running the op in an
fx.Interpreter: the ops already ran once during capture, and running them again would double the
cost of the whole account.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxacct.costs import CostContext, Flops, lookup
from fxacct.costs.registry import ZERO
from fxacct.errors import FxacctError, UsageError
from fxacct.trace import aliasing
from fxacct.trace.dispatch_recorder import BACKWARD, FORWARD, LOSS, RECOMPUTE
from fxacct.trace.frozen_init import fast_init
from fxacct.trace.graph_builder import INPUT, OP, NodeTrace, trace_of
from fxacct.trace.records import TensorMeta, map_nested, tensor_metas


@fast_init
@dataclass(frozen=True, slots=True)
class NodeCost:
    """Everything the account knows of one node (``node.meta["fxacct"]``)."""

    flops: Flops
    kind: str  # one of aliasing.KINDS
    output_bytes: int  # newly allocated bytes over all outputs (0 for views and in-place ops)
    saved_bytes: int  # bytes of this node's storages that autograd saves for backward
    saved_by_dtype: tuple[tuple[torch.dtype, int], ...]
    unsupported: bool  # no cost formula: FLOPs unknown, shown in every report
    phase: str = FORWARD  # forward / loss / backward / optimizer
    module: str = ""  # FQN: a forward op's own, a backward op's owner's
    owner: str | None = None  # name of the forward node this node's FLOPs and time belong to
    repeat: int = 1  # an optimizer op standing for this many parameters of one shape
    recompute: bool = False  # a forward op re-run in the backward (activation checkpointing)


def op_kind(op, has_tensor_inputs: bool) -> str:
    """view or inplace from the schema (fxacct.trace.aliasing); else creation, copy or compute
    from the cost registry's entry (a creation op, a data movement) and the tensor inputs."""
    kind = aliasing.schema_kind(op)
    if kind is not None:
        return kind
    info = lookup(op)
    if info is not None and info.creation:
        return aliasing.CREATION
    if not has_tensor_inputs:
        return aliasing.CREATION
    if info is not None and info.movement:
        return aliasing.COPY
    return aliasing.COMPUTE


def _shape(a):
    """Arguments with every tensor, TensorMeta or node replaced by its shape (a tuple; a tuple of
    shapes for a multi-output node)."""
    def one(x):
        return _shape(x.meta.get("val")) if isinstance(x, fx.Node) else tuple(x.shape)

    return map_nested(a, one, (torch.Tensor, TensorMeta, fx.Node))


def _has_tensor_arg(node: fx.Node) -> bool:
    return bool(node.all_input_nodes)


def _grad_mask(trace: NodeTrace):
    """Which tensor inputs of the forward op this backward op derives from required grad."""
    fwd = trace.derived_from
    return None if fwd is None else trace_of(fwd).args_requires_grad


def node_cost(node: fx.Node, causal_attention: str = "full") -> NodeCost:
    """The cost of one node alone (phase, module and owner are set by ``annotate``)."""
    op = node.target
    val = node.meta.get("val")
    trace = trace_of(node)
    saved = trace.saved
    saved_bytes = sum(b for b, _ in saved)
    by_dtype: dict[torch.dtype, int] = {}
    for b, dt in saved:
        by_dtype[dt] = by_dtype.get(dt, 0) + b
    saved_pairs = tuple(by_dtype.items())
    if node.op == "placeholder":
        kind = aliasing.INPUT if trace.role == INPUT else "parameter"
        return NodeCost(ZERO, kind, 0, saved_bytes, saved_pairs, False)
    kind = op_kind(op, _has_tensor_arg(node))
    outputs = tensor_metas(val)
    new_bytes = 0 if kind in (aliasing.VIEW, aliasing.INPLACE) else sum(t.nbytes for t in outputs)
    if kind == aliasing.VIEW:
        return NodeCost(ZERO, kind, 0, saved_bytes, saved_pairs, False)
    info = lookup(op)
    if info is None:
        return NodeCost(ZERO, kind, new_bytes, saved_bytes, saved_pairs, True)
    ctx = CostContext(causal_attention, _grad_mask(trace) if info.wants_grad_mask else None, op)
    out_shape = _shape(val)
    if info.source is None:
        flops = info.formula(*_shape(node.args), out_shape=out_shape, ctx=ctx, **_shape(node.kwargs))
    else:
        flops = _user_formula(info, op, _shape(node.args), _shape(node.kwargs), out_shape, ctx)
    if (flops.matmul or flops.attention) and info.source is None and outputs and outputs[0].dtype.is_complex:
        # a complex multiply-add is 4 real multiplies and 4 real adds: 8 FLOPs, 4x a real one's 2
        flops = Flops(matmul=4 * flops.matmul, attention=4 * flops.attention, other=flops.other)
    if flops.matmul and _in_attention(trace):  # SDPA's math path: its products are attention
        flops = Flops(matmul=0, attention=flops.attention + flops.matmul, other=flops.other)
    return NodeCost(flops, kind, new_bytes, saved_bytes, saved_pairs, False)


def _user_formula(info, op, args, kwargs, out_shape, ctx) -> Flops:
    """A --costs formula's Flops: what it raises or a return that is no Flops of counts >= 0 is the
    user's to fix (a usage error naming the file), not an error of fxacct."""
    try:
        flops = info.formula(*args, out_shape=out_shape, ctx=ctx, **kwargs)
    except Exception as e:
        raise UsageError(f"--costs {info.source}: the formula for {op} raised {type(e).__name__}: {e}; "
                         "fix it") from e
    if not isinstance(flops, Flops) or any(not isinstance(v, (int, float)) or v < 0
                                            for v in (flops.matmul, flops.attention, flops.other)):
        raise UsageError(f"--costs {info.source}: the formula for {op} returned {flops!r}; return "
                         "fxacct.costs.Flops(matmul=..., attention=..., other=...) with counts >= 0")
    return flops


def _in_attention(trace: NodeTrace) -> bool:
    fwd = trace.derived_from
    return trace.scope == "attention" or (fwd is not None and trace_of(fwd).scope == "attention")


def annotate(graph: fx.Graph, causal_attention: str = "full") -> fx.Graph:
    """Write NodeCost into every placeholder and op node; getitem plumbing gets none."""
    forward: dict[fx.Node, int] = {}  # forward node -> its position among them
    last_forward = None
    # a replayed block's ops repeat their template's op for op (fxacct.trace.replay_train): costed
    # once per template record (and storages saved), whatever the number of blocks
    repeated: dict[tuple[int, tuple], NodeCost] = {}
    for node in graph.nodes:
        if node.op == "output" or node.target is operator.getitem:
            continue
        trace = trace_of(node)
        key = (id(trace.origin), trace.saved) if trace.origin is not None else None
        cost = repeated.get(key) if key is not None else None
        if cost is None:
            try:
                cost = node_cost(node, causal_attention)
            except FxacctError:  # a --costs formula's (_user_formula): the user's, said as such
                raise
            except Exception as e:  # a formula bug must name the node it failed on
                raise RuntimeError(f"costing {node.format_node()} failed: {e}") from e
            if key is not None:
                repeated[key] = cost
        phase, owner = trace.phase, None
        if phase == FORWARD and (trace.role == OP or trace.role == INPUT):
            forward[node] = len(forward)
            owner = last_forward = node
        elif phase == BACKWARD:
            fwd = trace.derived_from
            if fwd is not None and trace_of(fwd).phase == LOSS:
                phase = LOSS
            elif fwd is None or fwd not in forward or _is_accumulation(node):
                owner = _orphan_owner(node, forward) or last_forward
            else:
                owner = fwd
        module = trace.module if owner is None or phase != BACKWARD else trace_of(owner).module
        node.meta["fxacct"] = NodeCost(cost.flops, cost.kind, cost.output_bytes, cost.saved_bytes,
                                       cost.saved_by_dtype, cost.unsupported, phase, module or "",
                                       owner.name if owner is not None else None, trace.repeat,
                                       trace.scope == RECOMPUTE)
    return graph


_ADDS = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)


def _is_accumulation(node: fx.Node) -> bool:
    """The engine summing the gradients of a tensor used twice (tied weights, a residual): an add
    of gradients that come from different forward ops. The engine runs it under whichever node
    delivered the second gradient, so its own link says nothing about where it belongs."""
    if node.target not in _ADDS:
        return False
    owners = {trace_of(a).derived_from for a in node.all_input_nodes if trace_of(a).phase == BACKWARD}
    owners.discard(None)
    return len(owners) > 1


def _orphan_owner(node: fx.Node, forward: dict[fx.Node, int]) -> fx.Node | None:
    """The latest forward node among the forward links of the ops feeding ``node``."""
    best, seen, stack = None, set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        trace = trace_of(n)
        fwd = trace.derived_from
        if fwd is not None:
            if fwd in forward and (best is None or forward[fwd] > forward[best]):
                best = fwd
        elif trace.phase == BACKWARD:
            stack.extend(n.all_input_nodes)
    return best
