"""FSDP2 inside a pipeline stage, as torch's pipelining drives it, for the stage peak replay
(fxacct.parallel.pipeline_memory).

A stage's trace is one plain FSDP2 step: each unit's parameters gathered into their unsharded
storages before its forward, freed after it (units that reshard after forward), gathered again for
its backward and freed after it, then its gradients reduce-scattered. torch 2.13's pipelining
(``stage.py``: ``backward_maybe_with_nosync`` turns resharding after backward and gradient
reduction off for every micro-batch's backward; ``perform_reduce_grad`` runs each unit's
``post_backward`` once, after the last one) holds memory differently over M micro-batches:

- A unit's unsharded storages are gathered when a forward or backward finds it sharded, freed after
  a forward if it reshards after forward, kept after a backward, and freed when its gradients are
  reduced at the end of the step. A gather that does not run makes no all-gather buffer either
  (the collectives follow the same rule: fxacct.parallel.pipeline_collectives).
- The unsharded gradients (what a reduce-scatter's ``fsdp.chunk_cat`` reads) made by a stage's
  first backward stay to the end; a later backward's are added into them (AccumulateGrad) and freed
  at the end of their autograd node (pipeline_memory's rule for any parameter gradient). Under a
  MixedPrecisionPolicy whose reduce dtype is another, each unit's post_backward casts the first
  backward's gradients to it (``to_accumulated_grad_if_needed``, kept to the end) and adds a later
  backward's into that copy (``accumulate_unsharded_grad_if_needed``), freeing the gradient.
- No backward reduces: each unit's reduce-scatter (its input buffer, ``chunk_cat``, the output that
  becomes the sharded gradients) runs once, at the end, unit by unit in ``fully_shard``'s state
  order (the module tree's pre-order: the reverse of the trace's backward), each unit's unsharded
  storages freed first and its unsharded gradients after; the previous unit's reduce-scatter input is
  freed as the next begins (FSDP2's ``reduce_scatter_max_input_buffers``, 1) and the last when
  the final callback ends.

The unsharded storages' allocations and frees are FSDP2's resizes noted while the stage was traced
(fxacct.parallel.fsdp_storage): an allocation at op i is live before op i runs, a free at op i takes
effect after it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from fxacct.trace import torch_private as tp
from fxacct.trace.records import tensor_metas


@functools.cache
def chunk_cats() -> frozenset:
    """The names of this release's reduce-scatter copy-in ops (read when a stage is replayed)."""
    return frozenset(str(op).rsplit(".", 1)[0] for op in tp.fsdp_reduce_scatter_copy_ins())


REDUCE_SCATTER = "c10d._reduce_scatter_base_"
COPY_OUT = "fsdp.split_with_sizes_copy"
COPY_IN = "fsdp.all_gather_copy_in"


@dataclass(frozen=True)
class Region:
    """One unit's gradient reduction in the trace."""

    ops: tuple[int, ...]  # op indices, birth of the reduce-scatter input through its output's last view
    grads: frozenset  # the unsharded gradients chunk_cat reads
    transient: frozenset  # storages born in the region that die within the step (the input buffer)
    # unsharded gradient -> its bytes in the reduce dtype, where that differs from the gradient's
    # (MixedPrecisionPolicy's reduce_dtype): FSDP2 accumulates in it (to_accumulated_grad_if_needed)
    cast: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FsdpStage:
    events: dict  # unsharded storage -> ((op index, allocated), ...) in trace order
    nbytes: dict  # unsharded storage -> its bytes when allocated
    buffers: dict  # all-gather buffer storage -> the unsharded storages its copy-out fills
    regions: tuple[Region, ...]  # in the trace's order (backward: last unit first)

    @property
    def grads(self) -> frozenset:
        return frozenset().union(*(r.grads for r in self.regions))

    @property
    def cast_grads(self) -> dict:
        return {sid: b for r in self.regions for sid, b in r.cast.items()}

    @property
    def region_ops(self) -> frozenset:
        return frozenset(i for r in self.regions for i in r.ops)


def fsdp_stage(ops: list, births: dict, resizes) -> FsdpStage | None:
    """The FSDP2 structure of a stage's trace; ``ops`` its call_function nodes in order (no
    getitem), ``births`` op index -> [(storage, birth, death, bytes)]; None without resizes."""
    if not resizes:
        return None
    born_at = {sid: (birth, death, nbytes) for entries in births.values() for sid, birth, death, nbytes in entries}
    events: dict[int, list] = {}
    for sid, index, allocated in resizes:
        events.setdefault(sid, []).append((index, allocated))
    nbytes = {}
    for sid, evs in events.items():
        if sid in born_at:  # made by this step (the first gather's empty): allocated at its birth
            events[sid] = [(born_at[sid][0], True)] + evs
            nbytes[sid] = born_at[sid][2]
    events = {sid: tuple(evs) for sid, evs in events.items() if sid in nbytes}
    buffers, regions, copy_ins = {}, [], []
    for i, node in enumerate(ops):
        name = _name(node)
        if name == COPY_OUT:
            source, outs = _storages(node.args[0]), _storages(node.kwargs.get("out", node.args[-1]))
            for sid in source:
                buffers[sid] = frozenset(outs) & events.keys()
        elif name == COPY_IN:
            copy_ins.append(node)
        elif name in chunk_cats():
            regions.append(_region(ops, i, node, born_at))
    for node in copy_ins:  # the shards cast to the all-gather dtype (MixedPrecisionPolicy) go with their gather
        unit = next((buffers[sid] for sid in _storages(node.args[1]) if sid in buffers), None)
        for sid in _storages(node.args[0]):
            if unit and sid in born_at:
                buffers[sid] = unit
    return FsdpStage(events, nbytes, buffers, tuple(r for r in regions if r is not None))


def _region(ops: list, i: int, chunk_cat, born_at: dict) -> Region | None:
    """The reduction whose chunk_cat is op i: from its output buffer's birth through the
    reduce-scatter (FSDP2's foreach_reduce runs them back to back) and then every op that reads
    what it wrote (the sharded gradients' views, HSDP's all-reduce)."""
    grads = frozenset(_storages(chunk_cat.args[0]))
    out = _storages(chunk_cat.kwargs.get("out", ()))
    out_dtype = _dtype(chunk_cat.kwargs.get("out"))
    cast = {}
    for node in chunk_cat.args[0]:
        for t in tensor_metas(node.meta.get("val")):
            if out_dtype is not None and t.dtype != out_dtype and t.storage in born_at:
                cast[t.storage] = born_at[t.storage][2] // t.dtype.itemsize * out_dtype.itemsize
    if not out or out[0] not in born_at:
        return None
    start, end, touched, scattered = born_at[out[0]][0], i, {out[0]}, False
    for j in range(i + 1, len(ops)):
        node = ops[j]
        reads, made = set(_storages(node.all_input_nodes)), set(_storages(node))
        if not scattered and _is_alloc(node):
            touched |= made
        elif not scattered and _name(node) == REDUCE_SCATTER and reads & touched:
            touched |= made
            scattered = True
        elif not (reads & touched):
            break
        else:
            touched |= made
        end = j
    if not scattered:
        return None
    index = range(start, end + 1)
    transient = frozenset(sid for sid, (birth, death, _) in born_at.items() if birth in index and death >= 0)
    return Region(tuple(index), grads, transient, cast)


def _is_alloc(node) -> bool:
    return node.target is torch.ops.aten.empty.memory_format


def _name(node) -> str:
    """An op's packet name: ``fsdp.chunk_cat`` for ``fsdp.chunk_cat.default``."""
    return str(node.target).rsplit(".", 1)[0]


def _dtype(node):
    metas = tensor_metas(node.meta.get("val")) if hasattr(node, "meta") else ()
    return metas[0].dtype if metas else None


def _storages(arg) -> list:
    """The storages of the tensors an FX argument (a node or a list of nodes) stands for."""
    nodes = arg if isinstance(arg, (list, tuple)) else [arg]
    return [t.storage for n in nodes if hasattr(n, "meta") for t in tensor_metas(n.meta.get("val"))]


class Gathered:
    """Which unsharded storages are allocated on one stage while its actions replay."""

    def __init__(self, fsdp: FsdpStage, stage: int):
        self.fsdp, self.key = fsdp, (stage, "fsdp")
        self.at: dict[int, list] = {}
        for sid, evs in fsdp.events.items():
            for index, allocated in evs:
                self.at.setdefault(index, []).append((sid, allocated))
        self.live: set[int] = set()
        self.starts = {r.ops[0]: r for r in fsdp.regions}
        self.first = True  # replaying the stage's first backward
        self.accumulated = (stage, "accumulated")

    def skip_birth(self, sid: int) -> bool:
        """A storage whose memory this class decides: unsharded ones, a skipped gather's buffer,
        and the reductions' storages (replayed at the end)."""
        if sid in self.fsdp.events:
            return True
        unit = self.fsdp.buffers.get(sid)
        return bool(unit) and unit <= self.live

    def before(self, i: int, walk, forward: bool, mb) -> None:
        for sid, allocated in self.at.get(i, ()):
            if allocated and sid not in self.live:
                self.live.add(sid)
                walk.hold((sid, self.key), self.fsdp.nbytes[sid])
        region = None if forward else self.starts.get(i)
        if region is not None:  # the unit's post_backward: a gradient in another dtype is accumulated
            for sid, nbytes in region.cast.items():
                walk.free(sid, mb)
                if self.first:
                    walk.hold((sid, self.accumulated), nbytes)

    def after(self, i: int, walk, forward: bool) -> None:
        if not forward:  # no resharding after a micro-batch's backward
            return
        for sid, allocated in self.at.get(i, ()):
            if not allocated:
                self._free(sid, walk)

    def reduce(self, walk, births: dict, first_backward) -> None:
        """perform_reduce_grad: each unit's reduction, root first (module docstring); a unit's
        unsharded storages are those whose last free in the trace comes right before its region."""
        regions = self.fsdp.regions
        owner: dict[int, list] = {}
        for sid, evs in self.fsdp.events.items():
            frees = [index for index, allocated in evs if not allocated]
            after = [k for k, r in enumerate(regions) if frees and r.ops[0] > frees[-1]]
            owner.setdefault(after[0] if after else None, []).append(sid)
        pending = []
        for k in reversed(range(len(regions))):
            region = regions[k]
            for sid in owner.get(k, ()):
                self._free(sid, walk)  # the unit's reshard, before its reduce-scatter
            for key in pending:
                walk.free(*key)
            pending = []
            for i in region.ops:
                for sid, _, _, nbytes in births.get(i, ()):
                    walk.hold((sid, self.key), nbytes)
                    if sid in region.transient:
                        pending.append((sid, self.key))
                walk.note()
            for sid in region.grads:
                walk.free(sid, self.accumulated if sid in region.cast else first_backward)
        for key in pending:
            walk.free(*key)
        for sid in list(self.live):
            self._free(sid, walk)

    def _free(self, sid: int, walk) -> None:
        if sid in self.live:
            self.live.discard(sid)
            walk.free(sid, self.key)
