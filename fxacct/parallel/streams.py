"""The step on the GPU's streams, as FSDP2 and c10d put the ops there, and its critical path
(networkx's longest path of a DAG whose edges carry their source op's duration).

Streams (torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py and
_fsdp_param_group.py):
- ``all_gather``: FSDP2's all-gather copy-in (``fsdp.all_gather_copy_in``, on its copy-in stream,
  which the all-gather stream waits for: ``all_gather_stream.wait_stream``, line 362, so one
  stream here) and its all-gathers (c10d ``_allgather_base_``);
- ``reduce_scatter``: FSDP2's reduce-scatters (c10d ``_reduce_scatter_base_``) and what follows
  them on that stream (``foreach_reduce``'s post-reduce ops: a backward op that reads only the
  reduce-scatter's output, line 685-);
- ``all_reduce``: HSDP's all-reduce (c10d ``allreduce_``), after the reduce-scatter
  (``all_reduce_stream.wait_stream(reduce_scatter_stream)``, line 654);
- ``p2p``: all-to-all, send and recv (c10d), on NCCL's stream, which waits for the current stream;
- ``compute``: everything else, tensor-parallel collectives included: DTensor issues functional
  collectives and waits for them where their output is used, so without async TP (not the
  default) they run exposed, in line with the compute.
A view (or a tuple's item) runs where the tensor it views was made; a buffer made for FSDP2's
all-gather copy-in or as a c10d collective's output (``all_gather_comm.allocate`` and
``reduce_scatter_comm.allocate`` run under the side stream) is made on that stream.

Edges: program order within each stream; each input's producer; a c10d collective's output buffer
to its readers; and FSDP2's waits:
- the reduce-scatter stream waits for the compute stream (``reduce_scatter_stream.wait_stream
  (current_stream)``, _fsdp_collectives.py:607), so does NCCL's p2p stream;
- the all-gather streams wait on the copy-out event of an earlier unit (``wait_for_unshard``,
  _fsdp_param_group.py:417-489): in forward the one before the unit just copied out (implicit
  prefetch keeps one all-gather result alive to overlap the next copy-out), in backward the
  unit just copied out; an explicit prefetch (``set_modules_to_forward_prefetch``) issues its
  all-gathers after the same waits, so the same edges hold;
- the compute stream waits for the previous reduce-scatter before the next one's copy-in
  (``reduce_scatter_max_input_buffers`` = 1, _fsdp_param_group.py:112, 645-658);
- the optimizer step waits for every reduce-scatter and all-reduce (``finalize_backward``
  waits on the post-reduce events, _fsdp_param_group.py:760-766).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

from fxacct.parallel.collectives import _OPS, is_collective

COMPUTE, ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, P2P = "compute", "all_gather", "reduce_scatter", "all_reduce", "p2p"
_C10D_STREAM = {"all_gather": ALL_GATHER, "reduce_scatter": REDUCE_SCATTER, "all_reduce": ALL_REDUCE}
_AG_COPY_IN = "fsdp.all_gather_copy_in"
_AG_COPY_OUT = "fsdp.split_with_sizes_copy"
_RS_COPY_IN = ("fsdp.chunk_cat", "fsdp.chunk_cat_mixed_dtype")  # torch 2.13-2.14, 2.15


@dataclass(frozen=True)
class Schedule:
    step_s: float  # the critical path
    busy_s: dict  # stream -> the summed durations of its ops
    compute_s: float  # the compute stream's ops other than collectives
    start_s: dict  # op -> the earliest it begins (its longest path from the step's start)
    stream: dict  # op -> its stream


def _op_name(n: fx.Node) -> str:
    return str(n.target).rsplit(".", 1)[0] if n.op == "call_function" else ""


def _phase(n: fx.Node) -> str | None:
    cost = n.meta.get("fxacct")
    return getattr(cost, "phase", None)


def stream_of(n: fx.Node, placed: dict[str, str]) -> str:
    """The stream ``n`` runs on; ``placed``: the streams of the nodes before it."""
    if n.target is operator.getitem or getattr(n.meta.get("fxacct"), "kind", None) == "view":
        src = next(iter(n.all_input_nodes), None)
        return placed.get(src.name, COMPUTE) if src is not None else COMPUTE
    if _op_name(n) == _AG_COPY_IN:
        return ALL_GATHER
    if is_collective(n) and n.target.namespace == "c10d":
        return _C10D_STREAM.get(_OPS[n.target][0], P2P)
    if not n.all_input_nodes:  # a buffer FSDP2 allocates on a side stream, for its copy-in or collective
        for user in n.users:
            if _op_name(user) == _AG_COPY_IN or (is_collective(user) and user.target.namespace == "c10d"
                                                  and user.args[_OPS[user.target][1]] is n):  # its output
                return stream_of(user, placed)
    inputs = {placed[a.name] for a in n.all_input_nodes if a.name in placed}
    if _phase(n) == "backward" and len(inputs) == 1 and inputs <= {REDUCE_SCATTER, ALL_REDUCE}:
        return inputs.pop()  # FSDP2's post-reduce ops (divide, cast to the parameter dtype) on that stream
    return COMPUTE


def critical_path(graph: fx.Graph, seconds: dict[str, float]) -> Schedule:
    """``seconds``: node name -> duration (compute ops and collectives alike)."""
    import networkx as nx  # a tenth of a second to import: only a --mesh with --gpu needs it

    g, placed = nx.DiGraph(), {}
    _add_step(g, placed, graph, seconds)
    start: dict[str, float] = {}  # the earliest each op can begin: the longest path to it
    for name in nx.topological_sort(g):
        start[name] = max((start[u] + w for u, _, w in g.in_edges(name, data="w")), default=0.0)
    step = max((start[v] + seconds.get(v, 0.0) for v in start), default=0.0)
    busy: dict[str, float] = {}
    compute = 0.0
    for n in graph.nodes:
        if n.name in placed:
            busy[placed[n.name]] = busy.get(placed[n.name], 0.0) + seconds.get(n.name, 0.0)
            if placed[n.name] == COMPUTE and not is_collective(n):
                compute += seconds.get(n.name, 0.0)
    return Schedule(step, busy, compute, start, placed)


def _add_step(g, placed: dict[str, str], graph: fx.Graph, seconds: dict[str, float]) -> None:
    """Into the DiGraph ``g``, every op of the step and the edges of the module docstring, each
    weighted by its source op's duration; into ``placed``, each op's stream."""
    last: dict[str, str] = {}
    buffer_writer: dict[fx.Node, str] = {}
    copy_outs: list[str] = []
    last_rs = None
    optimizer_started = False

    def edge(src: str | None, dst: str):
        if src is not None and src != dst:
            g.add_edge(src, dst, w=seconds.get(src, 0.0))

    for n in graph.nodes:
        if n.op != "call_function":
            continue
        s = stream_of(n, placed)
        placed[n.name] = s
        g.add_node(n.name)
        for a in n.all_input_nodes:
            if a.name in g:
                edge(a.name, n.name)
            if a in buffer_writer:
                edge(buffer_writer[a], n.name)
        if n.target is operator.getitem:
            continue
        edge(last.get(s), n.name)
        name = _op_name(n)
        if s in (REDUCE_SCATTER, P2P):
            edge(last.get(COMPUTE), n.name)  # wait_stream(current_stream)
        if s == ALL_REDUCE:
            edge(last.get(REDUCE_SCATTER), n.name)
        if s == ALL_GATHER:  # the all-gather streams' wait on an earlier copy-out event
            back = 1 if _phase(n) == "backward" else 2
            if len(copy_outs) >= back:
                edge(copy_outs[-back], n.name)
        if name in _RS_COPY_IN:
            edge(last_rs, n.name)  # at most one reduce-scatter input in flight
        if s == REDUCE_SCATTER and is_collective(n):
            last_rs = n.name
        if _phase(n) == "optimizer" and not optimizer_started:
            optimizer_started = True
            for side in (REDUCE_SCATTER, ALL_REDUCE):
                edge(last.get(side), n.name)
        if name == _AG_COPY_OUT:
            copy_outs.append(n.name)
        if is_collective(n) and n.target.namespace == "c10d" and isinstance(n.args[_OPS[n.target][1]], fx.Node):
            buffer_writer[n.args[_OPS[n.target][1]]] = n.name
        last[s] = n.name
