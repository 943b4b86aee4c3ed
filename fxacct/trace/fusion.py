"""The kernels inductor would make of a compiled region's graphs: a stated model of its fusion.

Inductor's scheduler cannot run here without generating code (it lowers to its own IR first, whose
buffers a CPU build then compiles), so fxacct models its rules (torch/_inductor/scheduler.py,
``can_fuse`` / ``score_fusion``; torch/_inductor/lowering.py for what falls back):

- views (permute, view, expand, slice, ...) are index arithmetic inside the kernels that read
  them: no kernel and no bytes of their own;
- matrix products, convolutions and attention kernels are extern kernels (aten / oneDNN / flash
  calls), one each, never fused, and so are the ops whose lowering stores into a realized buffer
  (scatter, index_put, sorts and scans) (``extern_kernels.mm``; inductor's max-autotune templates may fuse
  a pointwise epilogue, which this model leaves out);
- every other op (pointwise, reductions, norms as their decompositions, embedding's gather, random
  masks) is fusible: it joins the kernel of a fusible producer (through views) when both iterate
  over the same number of elements, or when it is a reduction over that producer's elements
  (inductor's vertical fusion of a pointwise chain into its reduction and of a reduction's
  pointwise epilogue); producers of that size that it reads are merged into one kernel. A
  reduction over outer dimensions (batch norm's statistics, a bias gradient) ends its kernel:
  what reads its result runs in another (inductor's reduction hint: it cannot be fused in the
  reduction's loop).

Each kernel moves the bytes of the tensors it reads from outside itself and of the tensors it
writes that something outside reads (or the graph returns), once each: its intermediates stay in
registers. Missed, named: horizontal fusion of independent ops of equal size (fewer kernels than
here), the checks that refuse a fusion that would make a cycle or exceed inductor's size limits
(more kernels), template epilogues, and inductor's post-grad passes (pattern replacements).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxacct.trace.aliasing import VIEW, schema_kind

aten = torch.ops.aten
FREE = "view"  # the kernel key of a view: index arithmetic inside its readers, no kernel
EXTERN = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
    aten.convolution_backward.default, aten._scaled_mm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_cudnn_attention_backward.default,
    # ops whose lowering writes into a realized buffer (scatter-style stores, index_put, scans, sorts):
    # torch/_inductor/lowering.py (scatter_fallback, index_put_impl_, the scan and sort lowerings)
    aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two,
    aten.index_put.default, aten.index_put_.default, aten.index_add.default, aten.sort.default,
    aten.sort.stable, aten.cumsum.default, aten.embedding_dense_backward.default,
})


@dataclass(frozen=True)
class Kernels:
    """The kernels of some graphs: how many, of which extern, and the bytes they move."""

    kernels: int
    extern: int
    bytes_moved: int


def _tensors(val) -> list:
    """The tensors (FakeTensor, or fxacct's TensorMeta in a captured graph) of a node's val."""
    if isinstance(val, (tuple, list)):
        return [v for v in val if hasattr(v, "element_size")]
    return [val] if hasattr(val, "element_size") else []


def _nbytes(node: fx.Node) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(node.meta.get("val")))


def _numel(node: fx.Node) -> int:
    return max((t.numel() for t in _tensors(node.meta.get("val"))), default=0)


def _is_view(node: fx.Node) -> bool:
    return node.target is operator.getitem or schema_kind(node.target) == VIEW


@dataclass
class _Groups:
    """The kernels of a graph: views resolved to the node whose data they read, fused nodes by
    kernel id, and the extern (or, unfused, every) op on its own."""

    base: dict = field(default_factory=dict)  # a view (or getitem) -> the node whose data it reads
    group: dict = field(default_factory=dict)  # fusible node -> kernel id
    members: dict = field(default_factory=dict)  # kernel id -> its nodes, in graph order
    extern: list = field(default_factory=list)


def _grouped(graph: fx.Graph, fuse: bool, keep) -> _Groups:
    g = _Groups()
    size: dict[int, int] = {}  # kernel id -> elements its loop runs over
    outs: dict[int, set] = {}  # kernel id -> element counts of what its nodes make
    closed: set = set()  # reductions over outer dimensions: what reads them starts a kernel
    for n in graph.nodes:
        if n.op != "call_function" or not keep(n):
            continue
        inputs = [g.base.get(a, a) for a in n.all_input_nodes]
        if _is_view(n):
            g.base[n] = inputs[0] if inputs else n
            continue
        if n.target in EXTERN or not fuse:
            g.extern.append(n)
            continue
        numel = _numel(n)
        reads = max((_numel(a) for a in inputs), default=0)
        # a producer kernel whose loop this op runs in (same size, or a reduction over its
        # elements), or whose own results have this op's size (a reduction's epilogue)
        candidates = sorted({g.group[a] for a in inputs if a in g.group and a not in closed
                             and (size[g.group[a]] in (numel, reads) or numel in outs[g.group[a]])})
        if candidates:
            gid = candidates[0]
            for other in candidates[1:]:  # producers of the same size that it reads: one kernel
                for m in g.members.pop(other):
                    g.group[m] = gid
                    g.members[gid].append(m)
                outs[gid] |= outs.pop(other)
                size.pop(other)
        else:
            gid = len(g.group)  # a fresh id (ids are never reused: one per node at most)
            size[gid], outs[gid], g.members[gid] = max(numel, reads), set(), []
        g.group[n] = gid
        g.members[gid].append(n)
        outs[gid].add(numel)
        if numel < reads and not _inner_reduction(n, inputs):
            closed.add(n)
    return g


def _squeezed(shape) -> tuple:
    return tuple(d for d in shape if d != 1)


def _inner_reduction(n: fx.Node, inputs: list) -> bool:
    """A reduction over the innermost dimensions (a layer norm's or softmax's rows): its readers
    run in the same outer loop, so inductor fuses them into its kernel. A reduction over outer
    dimensions (batch norm's statistics over N, H, W; a bias gradient over the batch) must end
    before anything reads it: its readers are another kernel."""
    out = _tensors(n.meta.get("val"))
    big = max((a for a in inputs if _tensors(a.meta.get("val"))), key=_numel, default=None)
    if not out or big is None:
        return False
    kept = _squeezed(out[0].shape)
    return kept == _squeezed(_tensors(big.meta.get("val"))[0].shape[:len(kept)]) if kept else False


def kernels(graph: fx.Graph, fuse: bool = True, keep=lambda node: True) -> Kernels:
    """The kernels of the call_function nodes of ``graph`` that ``keep`` accepts: fused under the
    model of the module docstring, or (``fuse=False``) one per op as eager runs them."""
    g = _grouped(graph, fuse, keep)
    moved = sum(_kernel_bytes(ms, g.base) for ms in g.members.values())
    moved += sum(_kernel_bytes([n], g.base) for n in g.extern)
    return Kernels(len(g.members) + len(g.extern), len(g.extern) if fuse else 0, moved)


@dataclass(frozen=True)
class GraphKernels:
    """One graph's fused kernels, for the runner: kernel id of each fused node, views (no kernel),
    the bytes each fused kernel moves, and the nodes whose results stay inside their kernel."""

    kernel_of: dict  # fx.Node -> kernel id (fused nodes; extern ops are absent)
    views: frozenset
    bytes_of: dict  # kernel id -> bytes moved
    internal: frozenset


def graph_kernels(graph: fx.Graph) -> GraphKernels:
    g = _grouped(graph, True, lambda node: True)
    return GraphKernels(dict(g.group), frozenset(g.base), {k: _kernel_bytes(ms, g.base) for k, ms in g.members.items()},
                        kernel_internal(graph))


def kernel_internal(graph: fx.Graph) -> frozenset:
    """The nodes whose results stay inside their fused kernel (every reader, through views, is in
    the same kernel): inductor never allocates a buffer for them."""
    g = _grouped(graph, True, lambda node: True)
    inside = set()
    for ms in g.members.values():
        own = set(ms)
        inside |= {n for n in ms if n.users and set(_data_users(n, g.base)) <= own}
    return frozenset(inside)


def _data_users(n: fx.Node, base: dict) -> list[fx.Node]:
    """The nodes that read ``n``'s data, through views."""
    out = []
    for u in n.users:
        out += _data_users(u, base) if u in base else [u]
    return out


def _kernel_bytes(nodes: list[fx.Node], base: dict) -> int:
    """What one kernel reads from outside itself and writes for outside (or for the graph's
    output, or nobody: an eager op's result is written whoever reads it), each tensor once."""
    inside = set(nodes)
    reads = {base.get(a, a) for n in nodes for a in n.all_input_nodes} - inside
    writes = [n for n in nodes if not set(_data_users(n, base)) <= inside or not n.users]
    return sum(_nbytes(a) for a in reads) + sum(_nbytes(n) for n in writes)


def region_kernels(graphs) -> Kernels:
    """The kernels of every compiled region's forward and backward graphs, added up."""
    parts = [kernels(gm.graph) for _, fw, bw in graphs for gm in (fw, bw) if gm is not None]
    return Kernels(sum(k.kernels for k in parts), sum(k.extern for k in parts), sum(k.bytes_moved for k in parts))
