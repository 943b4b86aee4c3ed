"""``fxacct plan``: the layouts of N GPUs that divide the GPUs and the global batch, each traced
once as one rank of the model parallelized by the engine (fxacct.parallel.profile), ranked by
predicted throughput among those that fit, and why the others were rejected.

A layout is ``fsdp=F,tp=T`` with F·T = N GPUs (T at most a node, inner: within it), the global
batch split over the F data-parallel ranks (each rank's micro-batch is global ÷ F; a tp group
shares one), and activation checkpointing off. Pipeline stages and checkpointing are not
enumerated yet."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fxacct.errors import FxacctError, UsageError


@dataclass(frozen=True)
class Candidate:
    mesh: str
    micro_batch: int
    peak_bytes: int | None = None
    capacity_bytes: int | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None  # the job's
    mfu: float | None = None
    rejected: str | None = None  # why it does not fit or cannot run, None if it does

    @property
    def fits(self) -> bool:
        return self.rejected is None


def layouts(gpus: int, global_batch: int, gpus_per_node: int) -> list[tuple[str, int]]:
    """(mesh, micro-batch per rank) for every tp dividing min(gpus, gpus_per_node) and gpus."""
    out = []
    for tp in range(1, min(gpus, gpus_per_node) + 1):
        if gpus % tp:
            continue
        fsdp = gpus // tp
        mesh = ",".join(f"{n}={s}" for n, s in (("fsdp", fsdp), ("tp", tp)) if s > 1) or "fsdp=1"
        out.append((mesh, global_batch // fsdp if global_batch % fsdp == 0 else 0))
    return out


def evaluate(config, mesh: str, micro_batch: int) -> Candidate:
    from fxacct.predict.devices import get_device
    from fxacct.profile import profile

    capacity = get_device(config.gpu).capacity_reported
    if micro_batch < 1:
        return Candidate(mesh, 0, rejected="the global batch does not divide over the data-parallel ranks")
    if mesh == "fsdp=1":
        return Candidate(mesh, micro_batch, rejected="one GPU: no layout to plan")
    try:
        p = profile(replace(config, mesh=mesh, batch=micro_batch, find_max_batch=False))
    except UsageError as e:  # tp beyond the heads, no plan for tp, ...
        return Candidate(mesh, micro_batch, rejected=str(e))
    except FxacctError as e:
        return Candidate(mesh, micro_batch, rejected=f"the model failed: {e}")
    peak = p.memory.peak_train.bytes
    t, th = p.parallel.time, p.parallel.throughput
    c = Candidate(mesh, micro_batch, peak, capacity, t.step_s if t else None, th.tokens_per_s_job, th.mfu)
    if peak > capacity:
        return replace(c, rejected=f"over memory by {peak - capacity:,} B ({peak / capacity:.2f}× the GPU)")
    return c


def plan(config, gpus: int, global_batch: int) -> tuple[Candidate, ...]:
    """Every layout, the fitting ones first by tokens/s (highest first), then the rejected."""
    if config.gpu is None:
        raise UsageError("fxacct plan needs --gpu NAME (capacity, peak FLOP/s and links)")
    if gpus < 2 or global_batch < 1:
        raise UsageError("--gpus must be at least 2 and --global-batch positive")
    cands = [evaluate(config, mesh, mb) for mesh, mb in layouts(gpus, global_batch, config.gpus_per_node)]
    fit = sorted((c for c in cands if c.fits), key=lambda c: -(c.tokens_per_s or 0.0))
    return tuple(fit + [c for c in cands if not c.fits])
