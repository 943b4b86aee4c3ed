"""pytest helpers: fail a test when a model stops fitting its GPU or outgrows its FLOP budget.

    from fxacct.testing import assert_fits, assert_flops

    def test_model_fits_8_h100s():
        with torch.device("meta"):  # no weights allocated
            model = MyModel()
        x = torch.empty(32, 2048, dtype=torch.long, device="meta")
        assert_fits(model, x, gpu="h100", optimizer="adamw", amp="bf16", world_size=8, shard="zero2")
        assert_flops(model, x, max_flops_per_example=3e12)

Both profile one training step on fake tensors (fxacct.profile_module: nothing is allocated and
the model is not changed) and raise an AssertionError whose message is the budget table of
`fxacct check`; on success they return the fxacct.tools.budgets.CheckResult.
"""

from __future__ import annotations

import torch

from fxacct.api import profile_module
from fxacct.dtypes import parse_dtype
from fxacct.errors import UsageError
from fxacct.load.config import Config
from fxacct.report.check_text import render_check
from fxacct.step import inputs_batch
from fxacct.tools.budgets import DEFAULT_MFU, CheckResult, Limits, evaluate
from fxacct.units import parse_bytes


def _inputs(inputs) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _dtype(value):
    return parse_dtype(value) if isinstance(value, str) else value


def _count(value, name: str) -> int | None:
    if value is None:
        return None
    if float(value) != int(value):
        raise UsageError(f"{name}={value!r} is not a whole number")
    return int(value)


def _check(model, inputs, limits: Limits, *, batch, dtype, amp, master_weights, **config) -> CheckResult:
    args, kwargs = _inputs(inputs)
    cfg = Config(target=type(model).__name__, batch=batch or inputs_batch(args, kwargs), dtype=_dtype(dtype),
                 amp=_dtype(amp), master_weights=master_weights, find_max_batch=False, **config)
    result = evaluate(profile_module(model, args, kwargs, cfg), limits)
    if not result.ok:
        raise AssertionError(render_check(result))
    return result


def assert_fits(model: torch.nn.Module, inputs, *, gpu: str = "h100", optimizer: str = "adamw",
                amp: str | torch.dtype | None = "bf16", dtype: str | torch.dtype | None = None,
                master_weights: bool = False, world_size: int = 1, shard: str = "none",
                max_memory: int | str | None = None, batch: int | None = None, **config) -> CheckResult:
    """One training step of ``model(*inputs)`` fits one rank of ``gpu``: what the rank needs of it
    (the step's peak reserved by the CUDA caching allocator plus the fixed costs outside it,
    fxacct.memory.reserved) is at most ``max_memory`` (bytes, or a size such as "80GB" /
    "79.6GiB"), by default the GPU's capacity as the driver reports it. ``inputs``: a tensor, a tuple of positional inputs, or a
    dict of keyword inputs (meta tensors are enough); ``batch`` defaults to their first dim.
    Other keyword arguments are fxacct.Config fields (optim_args, input_requires_grad, ...)."""
    try:
        limit = parse_bytes(max_memory) if isinstance(max_memory, str) else max_memory
    except ValueError as e:  # a size it cannot read: the caller's to fix, told as a usage error
        raise UsageError(f"max_memory={e}") from None
    return _check(model, inputs, Limits(max_memory_bytes=limit), batch=batch, dtype=dtype, amp=amp,
                  master_weights=master_weights, gpu=gpu, optimizer=optimizer, world_size=world_size,
                  shard=shard, **config)


def assert_flops(model: torch.nn.Module, inputs, *, max_flops: float | None = None,
                 max_flops_per_example: float | None = None, max_params: float | None = None,
                 max_step_time: float | None = None, mfu: float = DEFAULT_MFU,
                 require_no_unsupported_ops: bool = False, gpu: str | None = None,
                 optimizer: str = "adamw", amp: str | torch.dtype | None = None,
                 dtype: str | torch.dtype | None = None, master_weights: bool = False,
                 batch: int | None = None, **config) -> CheckResult:
    """One training step of ``model(*inputs)`` stays within its compute budgets: forward+backward
    FLOPs (``max_flops``, or ``max_flops_per_example``), parameters, a step time in seconds at
    ``mfu`` of ``gpu``'s peak, or no op without a cost formula."""
    from fractions import Fraction

    limits = Limits(max_params=_count(max_params, "max_params"), max_flops=_count(max_flops, "max_flops"),
                    max_flops_per_example=_count(max_flops_per_example, "max_flops_per_example"),
                    max_step_seconds=None if max_step_time is None else Fraction(max_step_time), mfu=mfu,
                    require_no_unsupported_ops=require_no_unsupported_ops, memory_defaults_to_gpu=False)
    if limits == Limits(mfu=mfu, memory_defaults_to_gpu=False):
        raise UsageError("assert_flops needs a budget: max_flops, max_flops_per_example, max_params, "
                         "max_step_time or require_no_unsupported_ops=True")
    return _check(model, inputs, limits, batch=batch, dtype=dtype, amp=amp, master_weights=master_weights,
                  gpu=gpu, optimizer=optimizer, **config)


__all__ = ["assert_fits", "assert_flops"]
