"""Input transfer: how long one batch takes to reach the GPU from pageable and from pinned memory.

A host tensor in ordinary (pageable) memory is first staged by the driver into a pinned buffer, and
``.to("cuda")`` waits for the copy; from page-locked memory (``pin_memory()``) the DMA engine reads
it directly and ``non_blocking=True`` returns at once, so the copy can overlap compute (PyTorch
docs, "A guide on good usage of non_blocking and pin_memory()"). Both are timed with CUDA events
around the copy of every input tensor of the batch, median of ``REPEATS``, after one warm-up copy.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from fxacct.trace import torch_private as tp

REPEATS = 5


@dataclass(frozen=True)
class Transfer:
    bytes: int  # one batch: every input tensor
    pageable_s: float  # .to(device) from pageable host memory
    pinned_s: float  # .to(device, non_blocking=True) from pinned host memory


def _copy_time(tensors, device, non_blocking: bool) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for t in tensors:
        t.to(device, non_blocking=non_blocking)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3  # ms -> s


def measure_transfer(args, kwargs, device: torch.device) -> Transfer | None:
    tensors = [t.detach().cpu() for t in tp.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)]
    if not tensors:
        return None
    pinned = [t.pin_memory() for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    times = {}
    for key, source, non_blocking in (("pageable", tensors, False), ("pinned", pinned, True)):
        _copy_time(source, device, non_blocking)
        times[key] = statistics.median(_copy_time(source, device, non_blocking) for _ in range(REPEATS))
    return Transfer(nbytes, times["pageable"], times["pinned"])


__all__ = ["Transfer", "measure_transfer"]
