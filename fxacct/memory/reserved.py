"""Reserved memory of a training run: each step's storages (fxacct.memory.peak.Lifetimes, exact at
the level of aten ops) replayed through the caching-allocator model (fxacct.memory.allocator), per
rank, with the fixed costs beside it (fxacct.memory.fixed). ``torch.cuda.max_memory_reserved()``
of a run counts its first steps, and those are where the segments are made: the first step has no
optimizer state until its optimizer makes it (torch.optim's ``_init_group``, lazily), and that
state then takes blocks from the segments the step's activations left in the cache, so the next
step needs new ones. Measured on an H200 (torch 2.11): a GPT-2 124M step reserves 5.68 GiB at
step 1, 7.21 GiB from step 2 on; an 8-layer Llama 11.98, 15.76, then 16.73 GiB from step 3 on.
A replay of one steady step (everything resident first) said 6.67 and 15.31.

The events, in the order a run makes them:
- set-up: the resident storages made before the first step, in Lifetimes order (parameters,
  buffers, inputs, master weights), then the blocks resident throughout under --shard (a gathered
  ZeRO-3 / FSDP unit);
- each step, op by op: the storages an op makes, then those that die at it (peak.walk's order);
  on the first step also the optimizer state where the traced step made it, and after the first
  matmul of each thread its cuBLAS workspace (the forward's thread, autograd's backward thread:
  fxacct.memory.fixed); at the step's end what it still holds (the gradients, set to None; the
  loss), dropped by the loop;
- steps until one reserves nothing new (MAX_STEPS).

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
from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx

from fxacct.load.alloc_conf import AllocConf
from fxacct.memory.allocator import CachingAllocator
from fxacct.memory.allocator_rules import DEFAULT_STREAM, Free, Malloc
from fxacct.memory.fixed import CUBLAS_THREADS, FixedCost, cublas_workspace_bytes, fixed_costs, outside_allocator
from fxacct.memory.peak import Lifetimes
from fxacct.trace.records import tensor_metas

ALL_GATHER_STREAM = "fsdp_all_gather_copy_in"
REDUCE_SCATTER_STREAM = "fsdp_reduce_scatter"
# a replay runs steps until one reserves nothing new: the state it ends in (the resident blocks, the
# same segments, each otherwise free and merged) is the one it began in, so every later step repeats
# it. A step that makes no segment of its own, in a run's third step at the latest on the models
# measured (docs/allocator.md), ends it; this bounds a replay that keeps releasing and remapping.
MAX_STEPS = 8
_STREAM_OF_OP = {"c10d._allgather_base_.default": ALL_GATHER_STREAM,
                 "c10d._reduce_scatter_base_.default": REDUCE_SCATTER_STREAM}


@dataclass(frozen=True)
class ReservedAccount:
    """Reserved and allocated bytes of one rank's step as the CUDA caching allocator holds them."""

    peak_reserved_bytes: int  # torch.cuda.max_memory_reserved() of a run (module docstring)
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


def _resident(life: Lifetimes, shards: dict[str, int]) -> list[tuple[Malloc, int | None]]:
    """(the allocation of each resident storage a rank holds, the op of the first step that makes
    it or None: made before the run's first step)."""
    births = life.resident_births or (None,) * len(life.resident)
    out = []
    for i, ((category, nbytes), made) in enumerate(zip(life.resident, births)):
        size = _per_rank(nbytes, shards.get(category, 1))
        if size:
            out.append((Malloc(("resident", i), size), made))
    return out


def setup_events(life: Lifetimes, shards: dict[str, int] | None = None, extra: dict[str, int] | None = None) -> list:
    """What exists before a run's first step: the resident storages made before it (parameters,
    buffers, inputs, master weights), in Lifetimes order, then ``extra`` (resident throughout
    under --shard: a gathered ZeRO-3 / FSDP unit)."""
    events = [malloc for malloc, made in _resident(life, shards or {}) if made is None]
    return events + [Malloc(("extra", category), nbytes) for category, nbytes in (extra or {}).items() if nbytes]


def step_events(life: Lifetimes, streams: dict[int, str] | None = None, shards: dict[str, int] | None = None,
                step: int = 0, workspace: int = 0) -> list:
    """The allocator events of a run's step ``step`` (0: the first; module docstring): op by op
    the storages an op makes (on the first step also the resident ones it makes, and after the
    first matmul of each thread that thread's cuBLAS workspace of ``workspace`` bytes), then those
    that die at it; at the end, what the step still holds, which the loop drops."""
    streams, shards = streams or {}, shards or {}
    births: dict[int, list] = {}
    deaths: dict[int, list] = {}
    for malloc, made in _resident(life, shards) if step == 0 else ():
        if made is not None:
            births.setdefault(made, []).append(malloc)
    sids = life.born_storages or (None,) * len(life.born)
    for j, ((birth, death, category, nbytes), sid) in enumerate(zip(life.born, sids)):
        size = _per_rank(nbytes, shards.get(category, 1))
        if size:
            births.setdefault(birth, []).append(Malloc(("born", step, j), size, streams.get(sid, DEFAULT_STREAM)))
            deaths.setdefault(death, []).append(Free(("born", step, j)))
    if step == 0 and workspace:  # after the op's outputs, as the kernel's launch asks for it
        for thread, op in zip(CUBLAS_THREADS, life.first_cublas_ops):
            if op is not None:
                births.setdefault(op, []).append(Malloc(("cublas", thread), workspace))
    events: list = []
    for i in range(len(life.op_names) + 1):  # index len(op_names): alive at the step's end
        events += births.get(i, ())
        events += deaths.get(i, ())
    return events


def cublas_threads(life: Lifetimes) -> tuple[str, ...]:
    """The threads of the step that run matmuls, each holding a cuBLAS workspace (fxacct.memory.fixed)."""
    return tuple(thread for thread, op in zip(CUBLAS_THREADS, life.first_cublas_ops) if op is not None)


def replay_run(allocator: CachingAllocator, life: Lifetimes, streams=None, shards=None, extra=None,
               workspace: int = 0) -> int:
    """Replay a run into ``allocator``: set-up, then steps until one reserves nothing new (module
    docstring), at most MAX_STEPS. Returns the steps replayed."""
    for event in setup_events(life, shards, extra):
        allocator.apply(event)

    def run_step(step: int) -> None:
        for event in step_events(life, streams, shards, step, workspace):
            allocator.apply(event)

    return until_steady(allocator, run_step)


def until_steady(allocator: CachingAllocator, run_step: Callable[[int], None]) -> int:
    """``run_step(k)`` for the run's steps k = 0, 1, ... into ``allocator`` until one reserves
    nothing new, at most MAX_STEPS (module docstring). Returns the steps run."""
    for step in range(MAX_STEPS):
        before = allocator.reserved, allocator.segments
        run_step(step)
        if step and (allocator.reserved, allocator.segments) == before:
            return step + 1
    return MAX_STEPS


def communicators(mesh) -> int:
    """Process groups of more than one rank a rank joins: one per mesh dimension of size > 1."""
    if mesh is None:
        return 0
    return sum(1 for _, size in mesh.dims if size > 1)


def reserved_account(life: Lifetimes, gpu: str, capacity: int, conf: AllocConf, streams=None, shards=None,
                     extra=None, comms: int = 0) -> ReservedAccount:
    """Replay one rank's run on ``gpu`` (a fxacct.devices key) of ``capacity`` bytes."""
    allocator, fixed = rank_allocator(gpu, capacity, conf, comms, cublas_threads(life))
    replay_run(allocator, life, streams, shards, extra, cublas_workspace_bytes(gpu))
    return replayed(allocator, fixed, conf)


def rank_allocator(gpu: str, capacity: int, conf: AllocConf, comms: int,
                   threads: tuple[str, ...]) -> tuple[CachingAllocator, tuple]:
    """(a caching allocator with what the GPU leaves it, the rank's fixed costs): the capacity less
    the fixed lines outside the allocator (the CUDA context, NCCL's buffers for ``comms`` groups);
    ``threads``: those holding a cuBLAS workspace."""
    fixed = fixed_costs(gpu, comms, threads)
    return CachingAllocator(conf, capacity - outside_allocator(fixed)), fixed


def replayed(allocator: CachingAllocator, fixed: tuple, conf: AllocConf) -> ReservedAccount:
    """The ReservedAccount of a replay that has run (rank_allocator's, its events applied)."""
    r = allocator.result()
    return ReservedAccount(r.peak_reserved_bytes, r.peak_allocated_bytes, r.reserved_at_peak, conf.text,
                           conf.expandable_segments, fixed, math.floor(allocator.capacity), r.alloc_retries,
                           r.oom_events)
