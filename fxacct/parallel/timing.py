"""Step time with communication: the critical path over one compute stream and one
communication stream (networkx's longest path of a DAG).

Nodes are the ops of the rank's graph with their durations: compute ops their roofline time
(fxacct.predict.roofline), collectives their α–β time (fxacct.parallel.links). Edges: program
order within each stream; a collective is issued after the compute op before it (the host
launches it there); data edges from each input's producer; a c10d collective that writes into a
buffer is followed by every later op that reads that buffer. What FSDP2 prefetches then overlaps
compute, and what TP's outputs need (their all-reduce's wait) sits on the path."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

from fxacct.devices import get_device
from fxacct.parallel.collectives import _OPS, _fn, is_collective
from fxacct.parallel.links import LINKS, collective_seconds, within_node
from fxacct.predict.roofline import for_config, gpu_key, matmul_dtype, predict
from fxacct.trace.dispatch_recorder import OPTIMIZER

END = "__end__"


@dataclass(frozen=True)
class ParallelTime:
    step_s: float  # the critical path
    compute_s: float  # the compute stream's ops, one after another
    comm_s: float  # every collective, one after another
    links: str  # the source of the link figures
    gpus_per_node: int
    optimizer_s: float = 0.0  # the optimizer step's ops (on the compute stream, after the backward)

    @property
    def exposed_comm_s(self) -> float:
        return max(0.0, self.step_s - self.compute_s)


def critical_path(graph: fx.Graph, op_seconds: dict[str, float], comm_seconds: dict[str, float]) -> float:
    import networkx as nx  # a tenth of a second to import: only a --mesh with --gpu needs it

    g = nx.DiGraph()
    last = {"compute": None, "comm": None}
    buffer_writer: dict[fx.Node, str] = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        on_comm = is_collective(n) and n.target is not _fn.wait_tensor.default
        g.add_node(n.name)
        for a in n.all_input_nodes:
            if a.name in g:
                g.add_edge(a.name, n.name, w=_weight(a, op_seconds, comm_seconds))
            if a in buffer_writer:
                g.add_edge(buffer_writer[a], n.name, w=comm_seconds.get(buffer_writer[a], 0.0))
        if n.target is operator.getitem:
            continue
        stream = "comm" if on_comm else "compute"
        prev = last[stream]
        if prev is not None:
            g.add_edge(prev.name, n.name, w=_weight(prev, op_seconds, comm_seconds))
        if on_comm and last["compute"] is not None:
            g.add_edge(last["compute"].name, n.name, w=op_seconds.get(last["compute"].name, 0.0))
        if on_comm and n.target.namespace == "c10d" and isinstance(n.args[_OPS[n.target][1]], fx.Node):
            buffer_writer[n.args[_OPS[n.target][1]]] = n.name
        last[stream] = n
    for name in list(g.nodes):
        node_w = comm_seconds.get(name, op_seconds.get(name, 0.0))
        g.add_edge(name, END, w=node_w)
    return nx.dag_longest_path_length(g, weight="w", default_weight=0.0)


def _weight(node: fx.Node, op_seconds, comm_seconds) -> float:
    return comm_seconds.get(node.name, op_seconds.get(node.name, 0.0))


@dataclass(frozen=True)
class Throughput:
    """Tokens per second of one step. A tensor-parallel group of T GPUs runs one batch together
    (each rank's trace holds the group's tokens), so one GPU's share is the group's / T."""

    tokens_per_s_gpu: float | None
    tokens_per_s_tp_group: float | None  # the batch the tp group shares (= per GPU without tp)
    tokens_per_s_job: float | None  # every data-parallel replica
    mfu: float | None  # model FLOPs of the rank ÷ (step time × the GPU's dense peak in the matmuls' dtype)


def predict_time(profile_parts, spec, config, nodes):
    """(ParallelTime, {collective node: seconds}) on config.gpu, or (None, {}) without one."""
    cap, peak = profile_parts
    if config.gpu is None:
        return None, {}
    links = LINKS[gpu_key(config.gpu) or config.gpu]
    placed = within_node(spec, config.gpus_per_node)
    comm = {c.node: collective_seconds(c.op, c.group_size, c.wire_bytes, links, placed.get(c.mesh_dim, False))
            for c in nodes}
    state = frozenset(s.key for s in cap.optimizer_state)
    predicted = predict(cap.graph, for_config(config), state, peak).ops
    ops = {o.node: o.seconds for o in predicted}
    compute = {k: v for k, v in ops.items() if k not in comm}
    step = critical_path(cap.graph, compute, comm)
    optimizer = sum(o.seconds for o in predicted if o.phase == OPTIMIZER and o.node not in comm)
    return ParallelTime(step, sum(compute.values()), sum(comm.values()), links.source, config.gpus_per_node,
                        optimizer), comm


def throughput(time: ParallelTime | None, totals, spec, config, graph: fx.Graph) -> Throughput:
    """The step's tokens per second and MFU; the peak is the GPU's in the dtype the traced
    matmuls run in (fxacct.predict.roofline.matmul_dtype), whatever casts the parameters."""
    if time is None or time.step_s <= 0:
        return Throughput(None, None, None, None)
    tokens = totals.batch * totals.tokens_per_example if totals.tokens_per_example else None
    group = tokens / time.step_s if tokens else None
    tp_size = spec.size("tp")
    job = group * spec.world_size / tp_size if group else None
    peak = get_device(config.gpu).matmul_peak(matmul_dtype(graph))
    return Throughput(group / tp_size if group else None, group, job, totals.model_flops / time.step_s / peak)
