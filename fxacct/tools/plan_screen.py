"""The planner's cheap screen: one rank's account of a layout from two short traces.

Rule (affine in the number of repeated blocks). Truncate the model to its first k and k+1
repeated blocks (the container that holds them, a ModuleList / ModuleDict / Sequential found as
fxacct.parallel.engine.repeated_blocks finds them, is shortened; everything else is kept) and
trace one rank of each. FLOPs, bytes (parameters, gradients, optimizer state, saved activations)
and collective wire bytes are sums over ops, and each block adds the same ops:
f(L) = f(k) + (L − k)·(f(k+1) − f(k)) for the L blocks of the whole model, exactly. The peak is a
maximum over the step of bytes live at once; at each moment those grow by a fixed amount per
block (k = 3, so that the first, a middle and the last block, where FSDP2's prefetching
differs, are in both traces), so the peak is the largest of such affine functions of L: convex,
and the same extrapolation is a lower bound on it, exact while the moment of the peak stays the
same kind (the tests hold both: equal on fp32 models, below the full trace where autocast moves
the peak at 10 blocks). The predicted time is a critical path of floats: equal up to rounding.
The model's forward must run whatever blocks the container holds (torchtitan's and Hugging
Face's loop over it); a model that does not is traced in full instead.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from fxacct.load.source import load_model
from fxacct.parallel.engine import block_containers

SCREEN_BLOCKS = 3


@dataclass(frozen=True)
class Point:
    """One rank's figures for one micro-batch step (the planner's view of a Profile)."""

    peak_bytes: int  # the training peak of the rank
    model_flops: int  # forward + backward matmul and attention
    recompute_flops: int  # activation checkpointing's re-run forward
    state_bytes: int  # parameters + gradients + optimizer state on the rank
    grad_bytes: int
    activation_bytes: int
    comm_bytes: int  # collective wire bytes
    step_s: float  # predicted: the critical path over compute and communication
    compute_s: float
    comm_s: float
    tokens_per_example: int  # 0 when the model has no token input (the same at any block count)
    optimizer_s: float = 0.0  # the optimizer step's part of step_s (once per step, whatever the micro-steps)
    # what the rank needs of the GPU, as `fxacct check --gpu` judges it (MemoryAccount.fit_bytes): the
    # caching allocator's reserved bytes at their peak plus the fixed costs outside it; from the screen a
    # lower bound, the extrapolated peak plus those fixed costs (``screen``)
    fit_bytes: int = 0
    fixed_bytes: int = 0  # the fixed costs outside the allocator (CUDA context, NCCL buffers): the same at any block count


def point(prof) -> Point:
    """The figures of a Profile under --mesh (with --gpu)."""
    mem, totals, par = prof.memory, prof.accounting.totals, prof.parallel
    t, reserved = par.time, mem.reserved
    return Point(mem.rank_peak.bytes, totals.model_flops, totals.recompute_flops,
                 mem.param_bytes + mem.grad_bytes + mem.optimizer_bytes + mem.master_bytes, mem.grad_bytes,
                 mem.activation_bytes, par.comm_wire_bytes, t.step_s, t.compute_s, t.comm_s,
                 totals.tokens_per_example or 0, t.optimizer_s,
                 reserved.fit_bytes if reserved is not None else mem.rank_peak.bytes,
                 reserved.fixed_outside_bytes if reserved is not None else 0)


@dataclass(frozen=True)
class PipePoint:
    """A pipeline layout's figures (the planner's view of a PipelineAccount): per stage, in order."""

    peak_bytes: int  # the largest rank's, the whole step replayed (fxacct.parallel.pipeline_memory)
    step_s: tuple[float, ...]  # each stage's micro-step, its optimizer step included
    optimizer_s: tuple[float, ...]
    model_flops: tuple[int, ...]
    tokens_per_example: int
    bubble_fraction: float  # the schedule's: the same at any block count
    timed: bool  # every stage carries a mesh time (pp with fsdp or tp)
    # what the largest rank needs of its GPU: its step through the caching allocator plus the fixed
    # costs outside it (PipelineAccount.largest_reserved; from the screen a lower bound, as Point's)
    fit_bytes: int = 0
    fixed_bytes: int = 0
    fit_is_bound: bool = False  # fit_bytes is the peak plus the fixed costs, a lower bound (pipe_point)


def pipe_point(pipe, capacity: int | None = None) -> PipePoint:
    """The figures of a PipelineAccount (with --gpu). What the largest rank needs of its GPU comes
    from every rank's step replayed through the caching allocator, unless its lower bound, the peak
    plus the fixed costs, is over ``capacity`` already (the replay can only add to it) or
    ``capacity`` is 0 (a screen's trace: the screen takes the bound)."""
    stages = pipe.stages
    timed = all(s.profile.parallel is not None and s.profile.parallel.time is not None for s in stages)
    times = [s.profile.parallel.time for s in stages] if timed else []
    bound = pipe.peak_bytes + pipe.fixed_outside_bytes
    reserved = None
    if capacity is None or bound <= capacity:
        reserved = pipe.with_reserved().largest_reserved
    return PipePoint(pipe.peak_bytes, tuple(t.step_s for t in times), tuple(t.optimizer_s for t in times),
                     tuple(s.profile.accounting.totals.model_flops for s in stages),
                     stages[0].profile.accounting.totals.tokens_per_example or 0, pipe.bubble_fraction, timed,
                     reserved.fit_bytes if reserved is not None else bound, pipe.fixed_outside_bytes,
                     reserved is None and pipe.replay is not None)


def _line(a, b, n: int):
    """a + n·(b − a), elementwise over tuples."""
    if isinstance(a, tuple):
        return tuple(_line(x, y, n) for x, y in zip(a, b))
    return a + n * (b - a)


def extrapolate(a, b, k: int, blocks: int):
    """f(blocks) from f(k) = a and f(k + 1) = b (the rule of the module docstring), for a Point,
    or a PipePoint with ``blocks`` and k per stage (its schedule's figures are the same at any k)."""
    keep = {"tokens_per_example", "bubble_fraction", "timed", "fixed_bytes", "fit_is_bound"} \
        if isinstance(a, PipePoint) else {"fixed_bytes"}
    got = type(a)(**{f.name: getattr(a, f.name) if f.name in keep else
                     _line(getattr(a, f.name), getattr(b, f.name), blocks - k) for f in fields(a)})
    # reserved bytes round to the allocator's blocks and segments, which no line through two traces
    # extrapolates; reserved is at least what is allocated, which is at least the tensors' bytes at
    # their peak: the extrapolated peak plus the fixed costs is a lower bound
    return replace(got, fit_bytes=got.peak_bytes + got.fixed_bytes)


def block_container(model: torch.nn.Module) -> tuple[torch.nn.Module, list[str]] | None:
    """(the list-like container holding the most repeated blocks, the keys of those blocks), or None
    (fxacct.parallel.engine.block_containers finds them, as FSDP2's units are found)."""
    lists = [(c, [k for k, _ in items]) for c, items in block_containers(model)
             if isinstance(c, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential))]
    return max(lists, key=lambda found: len(found[1])) if lists else None


def truncate(model: torch.nn.Module, k: int) -> torch.nn.Module:
    """The model with only its first k repeated blocks (in place; the model is on meta)."""
    found = block_container(model)
    if found is None:
        return model
    container, keys = found
    if isinstance(container, torch.nn.ModuleDict):
        for key in keys[k:]:
            del container[key]
    else:  # ModuleList / Sequential renumber what is left
        names = [n for n, _ in container.named_children()]
        for key in reversed(keys[k:]):
            del container[names.index(key)]
    return model


def truncated_loader(k: int):
    """A loader for fxacct.parallel.profile.profile_parallel: the model with k blocks."""
    def load(config):
        model, args, kwargs, inputs_for = load_model(config)
        return truncate(model, k), args, kwargs, inputs_for

    load.blocks = k  # the planner's cache key
    return load


def screen(config, blocks: int, trace) -> Point:
    """One layout's per-rank Point for a model of ``blocks`` blocks, from traces at k and k + 1
    blocks; ``trace(config, loader) -> Point`` does one trace (the planner caches it)."""
    k = SCREEN_BLOCKS
    if blocks <= k + 1:
        return trace(config, None)
    a, b = trace(config, truncated_loader(k)), trace(config, truncated_loader(k + 1))
    return extrapolate(a, b, k, blocks)


def pipeline_screens(blocks: int, stages: int) -> bool:
    """Whether a pipeline of ``stages`` is screened: with at least 2·(k + 1) blocks a stage (the
    two screens trace k and k + 1 a stage, together no more than one full trace)."""
    return blocks // stages >= 2 * (SCREEN_BLOCKS + 1)


def screen_pipeline(config, blocks: int, stages: int, trace) -> PipePoint:
    """A pipeline layout's PipePoint from two pipelines of the model cut to k and k + 1 blocks a
    stage (stages × k blocks, which the --pp-split function divides evenly), extrapolated to
    blocks ÷ stages a stage (rounded down where they do not divide: each figure then a lower
    bound, as the peak is anyway, the module docstring); ``trace(config, loader) -> PipePoint``."""
    k = SCREEN_BLOCKS
    a, b = trace(config, truncated_loader(stages * k)), trace(config, truncated_loader(stages * (k + 1)))
    return extrapolate(a, b, k, blocks // stages)


__all__ = ["Point", "PipePoint", "point", "pipe_point", "extrapolate", "truncate", "screen", "screen_pipeline",
           "pipeline_screens", "SCREEN_BLOCKS"]
