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

from dataclasses import dataclass, fields

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


def point(prof) -> Point:
    """The figures of a Profile under --mesh (with --gpu)."""
    mem, totals, par = prof.memory, prof.accounting.totals, prof.parallel
    t = par.time
    return Point(mem.rank_peak.bytes, totals.model_flops, totals.recompute_flops,
                 mem.param_bytes + mem.grad_bytes + mem.optimizer_bytes + mem.master_bytes, mem.grad_bytes,
                 mem.activation_bytes, par.comm_wire_bytes, t.step_s, t.compute_s, t.comm_s,
                 totals.tokens_per_example or 0, t.optimizer_s)


def extrapolate(a: Point, b: Point, k: int, blocks: int) -> Point:
    """f(blocks) from f(k) = a and f(k + 1) = b (the rule of the module docstring)."""
    n = blocks - k
    return Point(**{f.name: getattr(a, f.name) + n * (getattr(b, f.name) - getattr(a, f.name)) for f in fields(Point)})


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


__all__ = ["Point", "point", "extrapolate", "truncate", "screen", "SCREEN_BLOCKS"]
