"""Reserved memory of one training step: the step's storages (fxacct.memory.peak.Lifetimes, exact at
the level of aten ops) replayed through the caching-allocator model (fxacct.memory.allocator), per
rank, with the fixed costs beside it (fxacct.memory.fixed).

The events, in the order a steady-state step makes them:
- first, what exists before the step: the cuBLAS workspace of the default stream (allocated at the
  first matmul of the first step, kept), then the resident storages in Lifetimes order (parameters,
  buffers, inputs, optimizer state, master weights: allocated once, at set-up), then the
  blocks resident throughout under --shard (a gathered ZeRO-3 / FSDP unit);
- then op by op: the storages an op makes, then those that die at it (peak.walk's order).

Streams (torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): FSDP2's all-gather
output is allocated under ``device_handle.stream(all_gather_copy_in_stream)`` in
``foreach_all_gather`` (forward and pre-backward: ``get_all_gather_streams``), its reduce-scatter
output under ``reduce_scatter_stream`` in ``foreach_reduce``; the reduce-scatter input is allocated
before that ``with`` block, on the current (default) stream. FSDP2 keeps these buffers alive by
reference until the consuming stream has waited on their events (AllGatherState,
ReduceScatterState), and calls no record_stream, so each returns to its own stream's pool when
dropped. The c10d ops FSDP2 issues (``_allgather_base_``, ``_reduce_scatter_base_``) name those
buffers as their first argument. Everything else runs on the default stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.fx as fx

from fxacct.load.alloc_conf import AllocConf
from fxacct.memory.allocator import CachingAllocator
from fxacct.memory.allocator_rules import DEFAULT_STREAM, Free, Malloc
from fxacct.memory.fixed import FixedCost, cublas_workspace_bytes, fixed_costs, outside_allocator
from fxacct.memory.peak import Lifetimes
from fxacct.trace.records import tensor_metas

ALL_GATHER_STREAM = "fsdp_all_gather_copy_in"
REDUCE_SCATTER_STREAM = "fsdp_reduce_scatter"
_STREAM_OF_OP = {"c10d._allgather_base_.default": ALL_GATHER_STREAM,
                 "c10d._reduce_scatter_base_.default": REDUCE_SCATTER_STREAM}


@dataclass(frozen=True)
class ReservedAccount:
    """Reserved and allocated bytes of one rank's step as the CUDA caching allocator holds them."""

    peak_reserved_bytes: int  # torch.cuda.max_memory_reserved() of the step
    peak_allocated_bytes: int  # torch.cuda.max_memory_allocated(): blocks, rounded, workspaces included
    by_pool_stream: tuple[tuple[str, str, int], ...]  # (pool, stream, bytes) when reserved peaked
    alloc_conf: str  # the PYTORCH_CUDA_ALLOC_CONF the replay used ("" for torch's defaults)
    expandable_segments: bool
    fixed: tuple[FixedCost, ...]
    capacity_bytes: int  # what the allocator could take: the GPU's reported capacity less the fixed lines outside it
    alloc_retries: int  # mallocs that freed cached blocks to fit (release_cached_blocks)
    oom_events: int  # mallocs that did not fit even then

    @property
    def fixed_outside_bytes(self) -> int:
        """The fixed lines that are not already inside peak_reserved_bytes."""
        return outside_allocator(self.fixed)

    @property
    def fit_bytes(self) -> int:
        """What the GPU must hold: reserved at its peak plus what lives outside the allocator."""
        return self.peak_reserved_bytes + self.fixed_outside_bytes


def fsdp_streams(graph: fx.Graph) -> dict[int, str]:
    """storage id -> the side stream FSDP2 allocates it on (module docstring); others: default."""
    out: dict[int, str] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        stream = _STREAM_OF_OP.get(str(node.target))
        if stream is not None and node.args and isinstance(node.args[0], fx.Node):
            for t in tensor_metas(node.args[0].meta.get("val")):
                out.setdefault(t.storage, stream)
    return out


def _per_rank(nbytes: int, shards: int) -> int:
    return -(-nbytes // shards)  # as fxacct.memory.peak.walk: a rank holds at most the ceiling


def step_events(life: Lifetimes, streams: dict[int, str] | None = None, shards: dict[str, int] | None = None,
                extra: dict[str, int] | None = None, workspace: int = 0) -> list:
    """The allocator events of one step (module docstring)."""
    streams, shards = streams or {}, shards or {}
    events: list = [Malloc(("cublas", DEFAULT_STREAM), workspace)] if workspace else []
    for i, (category, nbytes) in enumerate(life.resident):
        size = _per_rank(nbytes, shards.get(category, 1))
        if size:
            events.append(Malloc(("resident", i), size))
    for category, nbytes in (extra or {}).items():
        if nbytes:
            events.append(Malloc(("extra", category), nbytes))
    births: dict[int, list] = {}
    deaths: dict[int, list] = {}
    sids = life.born_storages or (None,) * len(life.born)
    for j, ((birth, death, category, nbytes), sid) in enumerate(zip(life.born, sids)):
        size = _per_rank(nbytes, shards.get(category, 1))
        if not size:
            continue
        births.setdefault(birth, []).append(Malloc(("born", j), size, streams.get(sid, DEFAULT_STREAM)))
        deaths.setdefault(death, []).append(Free(("born", j)))
    for i in range(len(life.op_names)):
        events += births.get(i, ())
        events += deaths.get(i, ())
    return events


def communicators(mesh) -> int:
    """Process groups of more than one rank a rank joins: one per mesh dimension of size > 1."""
    if mesh is None:
        return 0
    return sum(1 for _, size in mesh.dims if size > 1)


def reserved_account(life: Lifetimes, gpu: str, capacity: int, conf: AllocConf, streams=None, shards=None,
                     extra=None, comms: int = 0) -> ReservedAccount:
    """Replay one rank's step on ``gpu`` (a fxacct.devices key) of ``capacity`` bytes."""
    allocator, fixed = rank_allocator(gpu, capacity, conf, comms)
    for event in step_events(life, streams, shards, extra, cublas_workspace_bytes(gpu)):
        allocator.apply(event)
    return replayed(allocator, fixed, conf)


def rank_allocator(gpu: str, capacity: int, conf: AllocConf, comms: int = 0) -> tuple[CachingAllocator, tuple]:
    """(a caching allocator with what the GPU leaves it, the rank's fixed costs): the capacity less
    the fixed lines outside the allocator (the CUDA context, NCCL's buffers for ``comms`` groups)."""
    fixed = fixed_costs(gpu, comms)
    return CachingAllocator(conf, capacity - outside_allocator(fixed)), fixed


def replayed(allocator: CachingAllocator, fixed: tuple, conf: AllocConf) -> ReservedAccount:
    """The ReservedAccount of a replay that has run (rank_allocator's, its events applied)."""
    r = allocator.result()
    return ReservedAccount(r.peak_reserved_bytes, r.peak_allocated_bytes, r.reserved_at_peak, conf.text,
                           conf.expandable_segments, fixed, math.floor(allocator.capacity), r.alloc_retries,
                           r.oom_events)
