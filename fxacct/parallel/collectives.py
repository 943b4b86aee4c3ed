"""Collectives as nodes: each c10d / functional-collective op the engine issued on the traced rank
becomes a node of kind ``collective`` with its op, mesh dimension, group size, phase, owning
module, the bytes of its output buffer on this rank and the bytes this rank puts on the wire.

Wire bytes follow the ring algorithms NCCL uses (Patarasuk & Yuan 2009; NCCL's
doc/PERFORMANCE.md "bus bandwidth"): with n ranks and a full (unsharded) tensor of S bytes,
all-gather and reduce-scatter send (n−1)/n·S per rank (n−1 steps of one S/n chunk); all-reduce,
a reduce-scatter followed by an all-gather, sends 2(n−1)/n·S; all-to-all sends the (n−1)/n of its
input bound for the other ranks; a broadcast (ZeRO-1's updated parameters) sends the whole tensor
from every rank but the last of the chain (NCCL's ring broadcast, bus bandwidth = algorithm
bandwidth in doc/PERFORMANCE.md: rank 0 counts it); a send sends its tensor, a recv nothing. The all-reduce figure
is floored to whole bytes when S is not a multiple of n.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from fxacct.costs.registry import register_zero
from fxacct.trace import torch_private as tp
from fxacct.trace.records import Ref, TensorMeta, tensor_metas

COLLECTIVE = "collective"
_c10d = torch.ops.c10d
_fn = torch.ops._c10d_functional

# op -> (name, where the output is, where the input is, where the group is); positions in args.
# The c10d ops write into a buffer the caller allocated (the node makes no new bytes); the
# functional ones return a fresh tensor.
_OPS = {
    _c10d._allgather_base_.default: ("all_gather", 0, 1, 2),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", 0, 1, 2),
    _c10d.allreduce_.default: ("all_reduce", 0, 0, 1),
    _c10d.alltoall_base_.default: ("all_to_all", 0, 1, 2),
    _c10d.broadcast_.default: ("broadcast", 0, 0, 1),
    _c10d.send.default: ("send", 0, 0, None),
    _c10d.recv_.default: ("recv", 0, 0, None),
    _fn.all_reduce.default: ("all_reduce", None, 0, 2),
    _fn.all_reduce_.default: ("all_reduce", 0, 0, 2),
    _fn.all_gather_into_tensor.default: ("all_gather", None, 0, 2),
    _fn.reduce_scatter_tensor.default: ("reduce_scatter", None, 0, 3),
    _fn.all_to_all_single.default: ("all_to_all", None, 0, 3),
    _fn.wait_tensor.default: ("wait", None, 0, None),
}
register_zero(*_OPS)  # no arithmetic (a reduction's adds are not model FLOPs); bytes and wire bytes below


# context parallelism's custom ops (torch/distributed/tensor/experimental/_context_parallel/_cp_custom_ops.py):
# one op gathers k and v along the sequence (two all_gather_single inside it), its backward reduce-
# scatters both gradients; a fake run sees the op, not the functional collectives inside it
_PAIRED: set = set()


@functools.cache
def register_cp_ops() -> None:
    """Add cplib.flex_cp_allgather and its backward to the table, once their module has made them."""
    import torch.distributed.tensor.experimental._context_parallel._cp_custom_ops  # noqa: F401 (defines the ops)

    ops = {torch.ops.cplib.flex_cp_allgather.default: ("all_gather", None, 0, 3),
           torch.ops.cplib.flex_cp_allgather_backward.default: ("reduce_scatter", None, 0, 3)}
    _OPS.update(ops)
    _PAIRED.update(ops)
    register_zero(*ops)


@functools.cache
def register_fsdp_copies() -> None:
    """FSDP2's copies into and out of its all-gather and reduce-scatter buffers (torch/distributed/
    fsdp/_fully_shard/_fsdp_collectives.py): bytes moved, no FLOPs. Registered when a mesh is first
    prepared (fxacct.parallel.rank_capture.prepare): their ops exist once torch.distributed.fsdp is
    imported, which a single-device profile has no need of (half a second of import)."""
    register_zero(*tp.fsdp_copy_ops(), movement=True)


@dataclass(frozen=True)
class CollectiveNode:
    node: str  # the graph node's name
    op: str  # all_gather, reduce_scatter, all_reduce, all_to_all, send, recv, wait
    mesh_dim: str  # the mesh dimension whose process group it ran on ("world", or the group's name)
    group_size: int
    phase: str
    module: str
    bytes: int  # the output buffer on this rank
    wire_bytes: int  # what this rank sends


@dataclass(frozen=True)
class CollectiveRow:
    """Collectives of one op on one mesh dimension, in one phase and module, summed."""

    op: str
    mesh_dim: str
    phase: str
    module: str
    count: int
    bytes: int
    wire_bytes: int
    predicted_ms: float | None = None  # not computed yet: null, never a placeholder


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _OPS


def _bytes(a, outputs: int = 1) -> int:
    """The bytes of a node's first ``outputs`` tensors (of each, in a list)."""
    if isinstance(a, (list, tuple)):
        return sum(_bytes(x, outputs) for x in a)
    if isinstance(a, fx.Node):
        return sum(t.nbytes for t in tensor_metas(a.meta.get("val"))[:outputs])
    return 0


def wire_bytes(op: str, n: int, out_bytes: int, in_bytes: int) -> int:
    """Bytes one rank sends in the ring algorithm (module docstring)."""
    if op == "all_gather":
        return out_bytes - in_bytes  # (n−1)/n of the gathered tensor: every chunk but its own
    if op == "reduce_scatter":
        return in_bytes - out_bytes  # (n−1)/n of the full input
    if op == "all_reduce":
        return 2 * (n - 1) * in_bytes // n
    if op == "all_to_all":
        return (n - 1) * in_bytes // n
    if op == "broadcast":
        return in_bytes if n > 1 else 0
    if op == "send":
        return in_bytes
    return 0


def _group(a, groups: dict) -> tuple[str, int]:
    if isinstance(a, torch.ScriptObject):  # a c10d op's ProcessGroup argument, boxed
        from torch.distributed.distributed_c10d import ProcessGroup

        a = ProcessGroup.unbox(a)
    name = a if isinstance(a, str) else getattr(a, "group_name", None)
    if name in groups:
        return groups[name]
    size = a.size() if hasattr(a, "size") and callable(a.size) else 1
    return str(name), size


def describe(node: fx.Node, groups: dict) -> CollectiveNode:
    op, out_at, in_at, group_at = _OPS[node.target]
    args = node.args
    out_bytes = _bytes(args[out_at]) if out_at is not None else _bytes(node, 2 if node.target in _PAIRED else 1)
    in_bytes = _bytes(args[in_at]) if node.target not in _PAIRED else _bytes(list(args[:2]))  # k and v
    dim, n = _group(args[group_at], groups) if group_at is not None and group_at < len(args) else ("", 1)
    if op == "all_gather" and in_bytes and n == 1:
        n = out_bytes // in_bytes
    cost = node.meta["fxacct"]
    return CollectiveNode(node.name, op, dim, n, cost.phase, cost.module, out_bytes,
                          wire_bytes(op, n, out_bytes, in_bytes))


def mark(graph: fx.Graph, groups: dict) -> tuple[CollectiveNode, ...]:
    """Set kind ``collective`` on every collective node (a c10d op writes into a buffer its caller
    allocated, so it makes no new bytes) and describe each one."""
    found = []
    for node in graph.nodes:
        if not is_collective(node):
            continue
        cost = node.meta["fxacct"]
        new = 0 if node.target.namespace == "c10d" or node.target is _fn.wait_tensor.default else cost.output_bytes
        node.meta["fxacct"] = replace(cost, kind=COLLECTIVE, output_bytes=new)
        found.append(describe(node, groups))
    return tuple(found)


def alias_waits(cap) -> None:
    """``wait_tensor`` returns its input (the functional collective's buffer, now complete); the
    fake kernel returns a fresh tensor instead. The wait's storage (and every view of it) is
    renamed to its input's, alive until the later of the two deaths, so the buffer counts once,
    as in a real run."""
    deaths = cap.deaths if cap.deaths is not None else {}
    alias: dict[int, TensorMeta] = {}

    def aliased(src, val) -> None:
        if isinstance(src, TensorMeta) and isinstance(val, TensorMeta) and src.storage != val.storage:
            alias[val.storage] = src
            if src.storage in deaths and val.storage in deaths:
                deaths[src.storage] = max(deaths[src.storage], deaths.pop(val.storage))
            else:  # the wait's output lives to the end of the step
                deaths.pop(src.storage, None)

    if cap.ops is not None:  # a capture kept without op nodes: its records, as the nodes' vals below
        records = cap.ops.records
        for i, r in enumerate(records):
            if r.op is _fn.wait_tensor.default and isinstance(r.args[0], Ref):
                aliased(cap.ops.val_of(r.args[0]), r.outputs)
            if alias and r.outputs is not None:
                renamed = _renamed(r.outputs, alias)
                if renamed is not r.outputs:  # (a record is rebuilt only where a storage is renamed)
                    records[i] = replace(r, outputs=renamed)
        return
    for node in cap.graph.nodes:
        if node.op == "call_function" and node.target is _fn.wait_tensor.default and isinstance(node.args[0], fx.Node):
            aliased(node.args[0].meta.get("val"), node.meta.get("val"))
        val = node.meta.get("val")
        if alias and val is not None:
            node.meta["val"] = _renamed(val, alias)


def _renamed(val, alias: dict):
    """``val`` with each aliased storage renamed; ``val`` itself where none is."""
    if isinstance(val, TensorMeta):
        src = alias.get(val.storage)
        return val if src is None else replace(val, storage=src.storage, storage_nbytes=src.storage_nbytes)
    if isinstance(val, tuple):
        new = tuple(_renamed(v, alias) for v in val)
        return val if all(a is b for a, b in zip(new, val)) else new
    return val


def rows(nodes: tuple[CollectiveNode, ...], seconds: dict | None = None) -> tuple[CollectiveRow, ...]:
    """Summed by (op, mesh dim, phase, module), in first-issue order; waits are not transfers.
    ``seconds``: node -> predicted seconds (fxacct.parallel.timing), else predicted_ms is null."""
    table: dict[tuple, list] = {}
    for c in nodes:
        if c.op == "wait":
            continue
        acc = table.setdefault((c.op, c.mesh_dim, c.phase, c.module), [0, 0, 0, 0.0])
        acc[0] += 1
        acc[1] += c.bytes
        acc[2] += c.wire_bytes
        acc[3] += (seconds or {}).get(c.node, 0.0) * 1e3
    return tuple(CollectiveRow(*key, *vals[:3], vals[3] if seconds else None) for key, vals in table.items())


def mesh_groups(mesh, spec) -> dict:
    """process-group name -> (mesh dimension, its size), the world group included."""
    import torch.distributed as dist

    groups = {dist.group.WORLD.group_name: ("world", spec.world_size)}
    for name in spec.names:
        g = mesh.get_group(name)
        groups[g.group_name] = (name, g.size())
    return groups
