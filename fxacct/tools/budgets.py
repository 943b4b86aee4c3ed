"""Budgets a profile must hold (`fxacct check`, fxacct.testing): each a frozen verdict with the
value, the limit and how far over. Values are for one rank, as every figure of a profile is
(DESIGN.md: `--batch` is the per-rank micro-batch; memory is what one GPU holds).

- memory: on a CUDA target (--gpu) what one rank needs of the GPU: the training step's peak
  reserved by the CUDA caching allocator plus the fixed costs outside it (CUDA context, NCCL
  buffers; fxacct.memory.reserved); without --gpu the per-rank training peak (peak_train_bytes;
  the inference peak for a model with nothing to train). Against --max-memory, by default the
  --gpu's capacity as the driver reports it (nvidia-smi memory.total, fxacct.devices), the memory a
  job can actually use.
- params: all parameters (trainable or not).
- flops: forward + backward FLOPs of one step, every class; flops_per_example: that ÷ batch.
- step_time: model FLOPs (forward + backward, matmul + attention: the FLOPs MFU is defined on)
  ÷ (the --gpu's matmul peak in the step's precision × MFU); the optimizer and loss are left out.
- unsupported_ops: op nodes without a cost formula (their FLOPs are unknown, not zero).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from fxacct.devices import get_device
from fxacct.dtypes import dtype_name
from fxacct.errors import UsageError
from fxacct.load.mesh import MeshSpec
from fxacct.load.quantities import DEFAULT_MFU, check_mfu
from fxacct.step import Profile


@dataclass(frozen=True)
class Limits:
    max_memory_bytes: int | None = None  # None: the --gpu's reported capacity, if a --gpu is set
    max_params: int | None = None
    max_flops: int | None = None  # forward + backward, one step on one rank
    max_flops_per_example: int | None = None
    max_step_seconds: Fraction | None = None
    mfu: float = DEFAULT_MFU
    require_no_unsupported_ops: bool = False
    memory_defaults_to_gpu: bool = True  # no max_memory_bytes: check the --gpu's capacity


@dataclass(frozen=True)
class Budget:
    name: str  # memory, params, flops, flops_per_example, step_time, unsupported_ops
    what: str  # the figure checked, e.g. "peak_train_bytes per rank"
    value: int | Fraction | float
    limit: int | Fraction | float
    unit: str  # bytes, params, FLOPs, s, ops
    limit_source: str  # where the limit came from: a flag, or the GPU

    @property
    def ok(self) -> bool:
        return self.value <= self.limit

    @property
    def over(self) -> int | Fraction | float:
        """value - limit (negative: headroom)."""
        return self.value - self.limit

    @property
    def over_fraction(self) -> float | None:
        """(value - limit) / limit; None for a limit of 0."""
        return float(Fraction(self.value) / Fraction(self.limit)) - 1 if self.limit else None


@dataclass(frozen=True)
class CheckResult:
    model: str | None
    budgets: tuple[Budget, ...]
    gpu: str | None = None  # the device's full name
    mfu: float | None = None  # assumed, for the step time
    peak_flops_per_s: float | None = None  # the matmul peak the step time uses
    peak_dtype: str | None = None

    @property
    def ok(self) -> bool:
        return all(b.ok for b in self.budgets)

    @property
    def failed(self) -> tuple[Budget, ...]:
        return tuple(b for b in self.budgets if not b.ok)


def _step_dtype(profile: Profile) -> torch.dtype:
    c = profile.config
    return c.amp or c.dtype or torch.float32


def validate(limits: Limits, gpu: str | None) -> None:
    """Fail fast, before any tracing: no budget at all, or one that needs a --gpu."""
    check_mfu(limits.mfu)
    memory = limits.max_memory_bytes is not None or (gpu is not None and limits.memory_defaults_to_gpu)
    if not (memory or limits.require_no_unsupported_ops or any(
            v is not None for v in (limits.max_params, limits.max_flops, limits.max_flops_per_example,
                                    limits.max_step_seconds))):
        raise UsageError("no budget to check: give --gpu NAME or --max-memory SIZE, --max-params, --max-flops, "
                         "--max-flops-per-example, --max-step-time or --require-no-unsupported-ops")
    if limits.max_step_seconds is not None and gpu is None:
        raise UsageError("--max-step-time needs --gpu NAME: the step time is the model FLOPs at that GPU's "
                         "peak × --mfu")


def _rank_peak(profile: Profile) -> tuple[int, str]:
    """(bytes, label) of the peak one rank holds: under --mesh pp=P the largest rank's over the
    whole step (its in-flight micro-batches included), else on a CUDA target the step's peak
    reserved plus the fixed costs outside the allocator, else the training peak (per rank under
    --shard or --mesh), or the inference peak of a model that does not train."""
    c, m, par = profile.config, profile.memory, profile.parallel
    if par is not None and par.pipeline is not None:
        if m.reserved is not None:  # the schedule's step through the allocator (fxacct.api._pipeline)
            return m.reserved.fit_bytes, "peak_reserved_bytes + fixed (the largest rank's step)"
        return par.pipeline.peak_bytes, "pipeline_peak_bytes (the largest rank's step)"
    shared = f" ({c.shard} over {c.world_size})" if c.shard != "none" else f" (--mesh {par.mesh})" if par else ""
    if m.reserved is not None:
        return m.reserved.fit_bytes, f"peak_reserved_bytes + fixed per rank{shared}"
    peak, what = m.rank_peak, "peak_train_bytes"
    if peak is None:
        peak, what = m.peak_inference, "peak_inference_bytes"
    return peak.bytes, f"{what} per rank{shared}"


def check_mesh(limits: Limits, mesh: MeshSpec | None) -> None:
    """Under fsdp and dp a rank runs the whole model on its own batch, so its FLOPs and step time are
    what one device's would be; under tp a rank's FLOPs are its share of its group's, under pp its
    stage's, and under pp its parameters too: those budgets are the model's, checked without --mesh
    (before any trace)."""
    if mesh is None:
        return
    spec = mesh
    split = [d for d in ("tp", "pp") if spec.size(d) > 1]
    given = [flag for flag, v in (("--max-flops", limits.max_flops), ("--max-flops-per-example",
             limits.max_flops_per_example), ("--max-step-time", limits.max_step_seconds)) if v is not None and split]
    given += ["--max-params"] if limits.max_params is not None and "pp" in split else []
    if given:
        why = "a rank holds its pipeline stage's parameters" if given[0] == "--max-params" else \
            "a rank's FLOPs are " + " and ".join(
                {"tp": "its share of its tensor-parallel group's work", "pp": "its pipeline stage's"}[d] for d in split)
        raise UsageError(f"{given[0]} with --mesh {mesh}: {why}, not the model's; check {given[0]} without "
                         "--mesh (or on fsdp/dp alone), and the per-rank memory with it")


def evaluate(profile: Profile, limits: Limits) -> CheckResult:
    """Every budget ``limits`` sets, checked against ``profile`` (validated as ``validate`` does)."""
    c, t = profile.config, profile.accounting.totals
    validate(limits, c.gpu)
    check_mesh(limits, c.mesh)
    device = get_device(c.gpu) if c.gpu is not None else None
    budgets, step = [], {}
    memory_limit, memory_source = limits.max_memory_bytes, "--max-memory"
    if memory_limit is None and device is not None and limits.memory_defaults_to_gpu:
        memory_limit, memory_source = device.capacity_reported, f"{device.name}, as the driver reports"
    if memory_limit is not None:
        peak, label = _rank_peak(profile)
        budgets.append(Budget("memory", label, peak, memory_limit, "bytes", memory_source))
    if limits.max_params is not None:
        params = profile.parallel.model_params if profile.parallel is not None else t.params
        budgets.append(Budget("params", "parameters" + (" (the model's)" if profile.parallel is not None else ""),
                              params, limits.max_params, "params", "--max-params"))
    step_flops = t.forward.total + t.backward.total
    if limits.max_flops is not None:
        budgets.append(Budget("flops", "forward+backward FLOPs per step", step_flops, limits.max_flops,
                              "FLOPs", "--max-flops"))
    if limits.max_flops_per_example is not None:
        per_example = Fraction(step_flops, c.batch)
        budgets.append(Budget("flops_per_example", "forward+backward FLOPs per example",
                              int(per_example) if per_example.denominator == 1 else per_example,
                              limits.max_flops_per_example, "FLOPs", "--max-flops-per-example"))
    if limits.max_step_seconds is not None:
        dtype = _step_dtype(profile)
        peak = device.matmul_peak(dtype)
        seconds = t.model_flops / (peak * limits.mfu)
        budgets.append(Budget("step_time", "model FLOPs ÷ (peak × MFU)", seconds, limits.max_step_seconds, "s",
                              "--max-step-time"))
        step = dict(mfu=limits.mfu, peak_flops_per_s=peak, peak_dtype=dtype_name(dtype))
    if limits.require_no_unsupported_ops:
        count = sum(profile.accounting.unsupported_ops.values())
        budgets.append(Budget("unsupported_ops", "op nodes without a cost formula", count, 0, "ops",
                              "--require-no-unsupported-ops"))
    return CheckResult(c.target, tuple(budgets), device.name if device is not None else None, **step)
