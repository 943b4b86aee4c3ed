"""Data-parallel partitioning per rank (ZeRO, Rajbhandari et al. 2020, §5; FSDP).

What each stage partitions across the N ranks of `--world-size`:
- none (DDP): nothing; every rank holds everything.
- zero1: optimizer state (with the fp32 master weights, which ZeRO counts in it).
- zero2: and gradients.
- zero3 / fsdp: and parameters; one unit's full parameters are gathered at a time, so the
  largest unit's parameters are resident besides the shard.
For mixed-precision Adam this gives the paper's 4Ψ+12Ψ/N (stage 1), 2Ψ+14Ψ/N (stage 2) and
16Ψ/N (stage 3); fxacct computes it from the real per-dtype tensors instead of the rule.
"""

from __future__ import annotations

import torch

from fxacct.load.specs import SHARDS, check  # noqa: F401  (re-exported)
from fxacct.memory.peak import GRADIENTS, MASTER_WEIGHTS, OPTIMIZER_STATE, PARAMETERS


def partitioned(shard: str, world_size: int) -> dict[str, int]:
    """category -> how many ways each of its storages is split."""
    n = world_size
    split = {}
    if shard in ("zero1", "zero2", "zero3", "fsdp"):
        split.update({OPTIMIZER_STATE: n, MASTER_WEIGHTS: n})
    if shard in ("zero2", "zero3", "fsdp"):
        split[GRADIENTS] = n
    if shard in ("zero3", "fsdp"):
        split[PARAMETERS] = n
    return split


def wrap_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules FSDP/ZeRO-3 gather one at a time: the items of every ModuleList, Sequential or
    ModuleDict of blocks (the usual auto-wrap policy wraps transformer blocks; torchtitan's models
    keep theirs in a ModuleDict), else the top-level children."""
    units = []
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)) and len(m) > 1:
            items = m.items() if isinstance(m, torch.nn.ModuleDict) else enumerate(m)
            units += [(f"{name}.{k}" if name else str(k), child) for k, child in items]
    return units or list(model.named_children())


def largest_unit_bytes(model: torch.nn.Module, dtype: torch.dtype | None) -> tuple[str, int]:
    best = ("", 0)
    for name, unit in wrap_units(model):
        seen, total = set(), 0
        for p in unit.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            dt = dtype if dtype is not None and p.is_floating_point() else p.dtype
            total += p.numel() * torch.empty((), dtype=dt, device="meta").element_size()
        if total > best[1]:
            best = (name, total)
    return best
