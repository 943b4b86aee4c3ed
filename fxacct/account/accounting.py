"""Accounting: the frozen results of one profile, aggregated from the annotated graph.

Per forward node: its forward FLOPs and the backward FLOPs of every backward op it owns (the owner
fxacct.account.annotate decided), so per-node figures always sum to the totals.
Per module: inclusive totals (a module includes its submodules), in named_modules() order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from fxacct.account.annotate import NodeCost
from fxacct.account.rollup import ancestors, inclusive  # noqa: F401  (ancestors re-exported)
from fxacct.costs.registry import ZERO, Flops, numel
from fxacct.dtypes import dtype_name
from fxacct.load.inputs import describe
from fxacct.trace.capture import BACKWARD, FORWARD, LOSS, OPTIMIZER, Capture, TensorMeta, itemsize, tensor_metas
from fxacct.trace.frozen_init import fast_init
from fxacct.trace.graph_builder import target_name


@fast_init
@dataclass(frozen=True, slots=True)
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
    activation_bytes: int  # every tensor autograd saves: the model's ops' and the loss's
    tokens_per_example: int | None
    batch: int
    loss_activation_bytes: int = 0  # of those, what the loss saves (a node row of no module)

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
    metas = tensor_metas(val)
    return metas[0] if metas else None


def _cost(node: fx.Node) -> NodeCost | None:
    return node.meta.get("fxacct")


@dataclass
class _Sums:
    """What one walk over the annotated graph adds up."""

    backward_of: dict  # forward node name -> backward Flops it owns
    loss_flops: int = 0
    optimizer_flops: int = 0
    recompute_flops: int = 0
    op_nodes: int = 0
    saved_total: int = 0
    saved_by_loss: int = 0
    saved_by_dtype: dict = field(default_factory=dict)
    unsupported: dict = field(default_factory=dict)


def _sum_graph(graph: fx.Graph, forward_nodes: list[fx.Node], count_recompute: bool) -> _Sums:
    sums = _Sums({n.name: ZERO for n in forward_nodes})
    for n in graph.nodes:
        cost = _cost(n)
        if cost is None:
            continue
        for dt, b in cost.saved_by_dtype:
            sums.saved_by_dtype[dtype_name(dt)] = sums.saved_by_dtype.get(dtype_name(dt), 0) + b
        sums.saved_total += cost.saved_bytes
        if cost.phase == LOSS:
            sums.saved_by_loss += cost.saved_bytes
        if n.op != "call_function":
            continue
        sums.op_nodes += 1
        if cost.unsupported:
            sums.unsupported[target_name(n.target)] = sums.unsupported.get(target_name(n.target), 0) + 1
        if cost.phase == LOSS:
            sums.loss_flops += cost.flops.total
        elif cost.phase == OPTIMIZER:
            sums.optimizer_flops += cost.flops.total * cost.repeat
        elif cost.phase == BACKWARD:
            if cost.recompute:
                sums.recompute_flops += cost.flops.total
                if not count_recompute:
                    continue
            if cost.owner is not None and cost.flops is not ZERO:  # a view's or copy's: nothing to add
                sums.backward_of[cost.owner] = sums.backward_of[cost.owner] + cost.flops
    return sums


def forward_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The nodes of the account's rows: forward ops and inputs (each its own owner)."""
    return [n for n in graph.nodes if (c := _cost(n)) is not None and c.phase == FORWARD and c.owner == n.name]


def _node_row(n: fx.Node, backward: Flops) -> NodeRow:
    cost = _cost(n)
    t = _first_tensor(n.meta.get("val"))
    return NodeRow(
        name=n.name, op="input" if n.op == "placeholder" else target_name(n.target), module=cost.module,
        shape=tuple(t.shape) if t is not None else (), dtype=dtype_name(t.dtype) if t is not None else None,
        kind=cost.kind, forward=cost.flops, backward=backward, activation_bytes=cost.saved_bytes,
        output_bytes=cost.output_bytes, unsupported=cost.unsupported,
    )


def account(capture: Capture, batch: int, tokens_per_example: int | None = None,
            count_recompute: bool = False) -> Accounting:
    """``count_recompute``: ops that activation checkpointing re-runs in the backward count in the
    backward FLOPs (hardware FLOPs); by default they are reported apart (model FLOPs)."""
    nodes = forward_nodes(capture.graph)
    sums = _sum_graph(capture.graph, nodes, count_recompute)
    rows = [_node_row(n, sums.backward_of[n.name]) for n in nodes]
    params = capture.params
    totals = Totals(
        forward=sum((r.forward for r in rows), ZERO), backward=sum((r.backward for r in rows), ZERO),
        loss_flops=sums.loss_flops, optimizer_flops=sums.optimizer_flops, recompute_flops=sums.recompute_flops,
        params=sum(numel(p.shape) for p in params),
        trainable_params=sum(numel(p.shape) for p in params if p.requires_grad),
        param_bytes=sum(numel(p.shape) * itemsize(p.dtype) for p in params),
        grad_bytes=sum(numel(p.shape) * itemsize(p.dtype) for p in params if p.got_grad),
        activation_bytes=sums.saved_total, tokens_per_example=tokens_per_example, batch=batch,
        loss_activation_bytes=sums.saved_by_loss,
    )
    inputs = tuple(describe(n.meta["val"]) for n in capture.input_nodes)
    return Accounting(totals, tuple(rows), _module_rows(rows, capture.module_names, sums.saved_by_loss),
                      dict(sorted(sums.saved_by_dtype.items())),
                      dict(sorted(sums.unsupported.items(), key=lambda kv: -kv[1])), sums.op_nodes, inputs)


def _module_rows(rows, module_names, loss_saved: int) -> tuple[ModuleRow, ...]:
    """Inclusive per-module sums; the loss runs outside every module, so the root row alone holds
    what it saves (the root row's activations are then the total's)."""
    totals = inclusive([(r.module, (r.forward, r.backward, r.activation_bytes)) for r in rows]
                       + [("", (ZERO, ZERO, loss_saved))])
    return tuple(ModuleRow(m, 0 if m == "" else m.count(".") + 1, *totals[m])
                 for m in module_names if m in totals)
