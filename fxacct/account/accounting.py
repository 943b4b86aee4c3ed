"""Accounting: the frozen results of one profile, aggregated from the annotated graph.

Per forward node: its forward FLOPs and the backward FLOPs of every backward op derived from it
(the autograd sequence-number link of fxacct.trace.capture). A backward op with no forward op of its
own (a gradient accumulation for a tensor used twice, e.g. tied weights) goes to the latest
forward node among the ops that feed it, so per-node figures always sum to the totals.
Per module: inclusive totals (a module includes its submodules), in named_modules() order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxacct.account.annotate import NodeCost
from fxacct.trace.capture import BACKWARD, FORWARD, LOSS, OPTIMIZER, Capture, TensorMeta, itemsize
from fxacct.trace.dispatch_recorder import RECOMPUTE
from fxacct.costs.registry import ZERO, Flops, numel
from fxacct.dtypes import dtype_name
from fxacct.load.inputs import describe


@dataclass(frozen=True)
class NodeRow:
    name: str
    op: str
    module: str
    shape: tuple[int, ...]
    dtype: str | None
    kind: str
    forward: Flops
    backward: Flops
    activation_bytes: int
    output_bytes: int
    unsupported: bool


@dataclass(frozen=True)
class ModuleRow:
    module: str
    depth: int
    forward: Flops
    backward: Flops
    activation_bytes: int


@dataclass(frozen=True)
class Totals:
    forward: Flops
    backward: Flops
    loss_flops: int
    optimizer_flops: int
    recompute_flops: int
    params: int
    trainable_params: int
    param_bytes: int
    grad_bytes: int
    activation_bytes: int
    tokens_per_example: int | None
    batch: int

    @property
    def model_flops(self) -> int:
        """Forward + backward matmul + attention: the FLOPs MFU and 6·N·D speak of."""
        return (self.forward.matmul + self.forward.attention
                + self.backward.matmul + self.backward.attention)

    @property
    def six_n_d(self) -> int | None:
        """The 6·N·D rule of thumb (N parameters, D = batch × tokens per example)."""
        if self.tokens_per_example is None:
            return None
        return 6 * self.params * self.batch * self.tokens_per_example


@dataclass(frozen=True)
class Accounting:
    totals: Totals
    nodes: tuple[NodeRow, ...]
    modules: tuple[ModuleRow, ...]
    activation_by_dtype: dict = field(default_factory=dict)  # dtype name -> saved bytes
    unsupported_ops: dict = field(default_factory=dict)  # "aten.x.default" -> node count
    node_count: int = 0  # op nodes in the whole graph (forward, loss, backward)
    input_shapes: tuple[str, ...] = ()


def _first_tensor(val) -> TensorMeta | None:
    if isinstance(val, TensorMeta):
        return val
    if isinstance(val, (tuple, list)):
        return next((v for v in val if isinstance(v, TensorMeta)), None)
    return None


def _cost(node: fx.Node) -> NodeCost | None:
    return node.meta.get("fxacct")


_ADDS = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)


def _is_accumulation(node: fx.Node) -> bool:
    """The engine summing the gradients of a tensor used twice (tied weights, a residual): an add
    of gradients that come from different forward ops. The engine runs it under whichever node
    delivered the second gradient, so its own link says nothing about where it belongs."""
    if node.target not in _ADDS:
        return False
    owners = {a.meta.get("fwd") for a in node.all_input_nodes if a.meta.get("phase") == BACKWARD}
    owners.discard(None)
    return len(owners) > 1


def _orphan_owner(node: fx.Node, order: dict[fx.Node, int]) -> fx.Node | None:
    """The latest forward node among the forward links of the ops feeding ``node``."""
    best, seen, stack = None, set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        fwd = n.meta.get("fwd")
        if fwd is not None:
            if best is None or order[fwd] > order[best]:
                best = fwd
        elif n.meta.get("phase") == BACKWARD:
            stack.extend(n.all_input_nodes)
    return best


def account(capture: Capture, batch: int, tokens_per_example: int | None = None,
            count_recompute: bool = False) -> Accounting:
    """``count_recompute``: ops that activation checkpointing re-runs in the backward count in the
    backward FLOPs (hardware FLOPs); by default they are reported apart (model FLOPs)."""
    graph = capture.graph
    forward_nodes = [n for n in graph.nodes if n.meta.get("phase") == FORWARD and _cost(n) is not None
                     and (n.op == "call_function" or n.meta.get("kind") == "input")]
    order = {n: i for i, n in enumerate(forward_nodes)}
    backward_of: dict[fx.Node, Flops] = {n: ZERO for n in forward_nodes}
    loss_flops = optimizer_flops = recompute_flops = 0
    unsupported: dict[str, int] = {}
    op_nodes = 0
    saved_total = 0
    saved_by_dtype: dict[str, int] = {}
    for n in graph.nodes:
        cost = _cost(n)
        if cost is None:
            continue
        for dt, b in cost.saved_by_dtype:
            saved_by_dtype[dtype_name(dt)] = saved_by_dtype.get(dtype_name(dt), 0) + b
        saved_total += cost.saved_bytes
        if n.op != "call_function":
            continue
        op_nodes += 1
        if cost.unsupported:
            unsupported[str(n.target)] = unsupported.get(str(n.target), 0) + 1
        phase = n.meta["phase"]
        if phase == LOSS:
            loss_flops += cost.flops.total
        elif phase == OPTIMIZER:
            optimizer_flops += cost.flops.total * n.meta.get("repeat", 1)
        elif phase == BACKWARD:
            if n.meta.get("scope") == RECOMPUTE:
                recompute_flops += cost.flops.total
                if not count_recompute:
                    continue
            owner = n.meta.get("fwd")
            if owner is None or owner not in backward_of or _is_accumulation(n):
                owner = _orphan_owner(n, order) or (forward_nodes[-1] if forward_nodes else None)
            if owner is not None:
                backward_of[owner] = backward_of[owner] + cost.flops

    rows = []
    for n in forward_nodes:
        cost = _cost(n)
        t = _first_tensor(n.meta.get("val"))
        rows.append(NodeRow(
            name=n.name, op="input" if n.op == "placeholder" else str(n.target),
            module=n.meta.get("module", ""), shape=tuple(t.shape) if t is not None else (),
            dtype=dtype_name(t.dtype) if t is not None else None, kind=cost.kind,
            forward=cost.flops, backward=backward_of[n], activation_bytes=cost.saved_bytes,
            output_bytes=cost.output_bytes, unsupported=cost.unsupported,
        ))
    # saved storages owned by loss-phase or parameter nodes are not forward-node activations;
    # parameters are excluded at capture, loss-phase saves are rare but counted in the total
    forward = sum((r.forward for r in rows), ZERO)
    backward = sum((r.backward for r in rows), ZERO)

    modules = _module_rows(rows, capture.module_names)
    param_bytes = sum(numel(p.shape) * itemsize(p.dtype) for p in capture.params)
    grad_bytes = sum(numel(p.shape) * itemsize(p.dtype) for p in capture.params if p.got_grad)
    totals = Totals(
        forward=forward, backward=backward, loss_flops=loss_flops, optimizer_flops=optimizer_flops,
        recompute_flops=recompute_flops,
        params=sum(numel(p.shape) for p in capture.params),
        trainable_params=sum(numel(p.shape) for p in capture.params if p.requires_grad),
        param_bytes=param_bytes, grad_bytes=grad_bytes, activation_bytes=saved_total,
        tokens_per_example=tokens_per_example, batch=batch,
    )
    inputs = tuple(describe(n.meta["val"]) for n in capture.input_nodes)
    return Accounting(totals, tuple(rows), modules, dict(sorted(saved_by_dtype.items())),
                      dict(sorted(unsupported.items(), key=lambda kv: -kv[1])), op_nodes, inputs)


def _module_rows(rows, module_names) -> tuple[ModuleRow, ...]:
    fwd: dict[str, Flops] = {}
    bwd: dict[str, Flops] = {}
    act: dict[str, int] = {}
    for r in rows:
        for m in ancestors(r.module):
            fwd[m] = fwd.get(m, ZERO) + r.forward
            bwd[m] = bwd.get(m, ZERO) + r.backward
            act[m] = act.get(m, 0) + r.activation_bytes
    return tuple(ModuleRow(m, 0 if m == "" else m.count(".") + 1, fwd[m], bwd[m], act[m])
                 for m in module_names if m in fwd)


def ancestors(fqn: str):
    """'a.b.c' -> 'a.b.c', 'a.b', 'a', '' (a module and every module that contains it)."""
    yield fqn
    while fqn:
        fqn = fqn.rpartition(".")[0]
        yield fqn
