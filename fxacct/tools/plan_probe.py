"""One layout's figures for ``fxacct plan`` (fxacct.tools.plan): a Planner probes a layout with
as few traces as it can and keeps every trace it ran, keyed by the per-rank shape it traced.

A trace is named by the layout's whole Config (mesh, micro-batch, checkpointing; with pp the
micro-batches per step too) and how much of the model it traced (the screen's block count): the
layouts that share one (a screen's k-block trace, a confirmation of a screened layout at the same
shape) run it once. With a TraceCache (fxacct.tools.plan_cache) they are also kept on disk for
the next run. Each probe says whether it ran a trace of its own ("traced") or took every figure
from traces already run ("reused").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from fxacct.devices import get_device
from fxacct.errors import FxacctError, UsageError
from fxacct.heap import collect_dropped
from fxacct.load.torchtitan import is_torchtitan
from fxacct.parallel.pipeline import profile_pipeline
from fxacct.parallel.profile import profile_parallel
from fxacct.parallel.torchtitan import compute_dtype, profile_torchtitan
from fxacct.parallel.torchtitan_pipeline import job_schedule as titan_schedule
from fxacct.parallel.torchtitan_pipeline import profile_torchtitan_pipeline
from fxacct.tools.plan_layouts import Layout, model_facts
from fxacct.tools.plan_screen import (
    SCREEN_BLOCKS,
    PipePoint,
    Point,
    pipe_point,
    pipeline_screens,
    point,
    screen,
    screen_pipeline,
)
from fxacct.units import format_bytes


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    peak_bytes: int | None = None  # per rank, for the whole step: the tensors' bytes at their peak
    step_s: float | None = None
    tokens_per_s: float | None = None  # the job's
    mfu: float | None = None
    source: str = "-"  # "traced" (a full trace), "screen" (extrapolated), "-" (no trace of its own)
    rejected: str | None = None  # why it does not fit or cannot run, None if it does
    dominated: str | None = None  # fits, but a layout of its group is faster (not traced)
    over_bytes: int | None = None  # fit − capacity when over memory (a lower bound from the screen)
    # forward + backward matmul and attention FLOPs of one step: A × the traced micro-step's, with
    # pp summed over the pipeline's stages (one replica of the model); None where nothing was traced
    model_flops: int | None = None
    # what a rank needs of the GPU, as `fxacct check --gpu` judges it and as the layout is judged here:
    # the allocator's reserved peak plus the fixed costs outside it (Point.fit_bytes, PipePoint's for
    # the largest rank of a pipeline; a lower bound from the screen)
    fit_bytes: int | None = None

    @property
    def fits(self) -> bool:
        return self.rejected is None and self.dominated is None

    @property
    def mesh(self) -> str:
        return self.layout.mesh

    @property
    def micro_batch(self) -> int:
        return self.layout.micro_batch

    @property
    def over_memory(self) -> bool:
        return self.over_bytes is not None


@dataclass(frozen=True)
class Probe:
    """One probe of a layout, as the progress line says it."""

    candidate: Candidate
    how: str  # "traced" (ran a trace of its own) or "reused" (every figure from traces already run)
    seconds: float


class Planner:
    """The search of one ``plan`` call, with its traces (module docstring); ``disk``: a TraceCache
    or None; ``on_probe(Probe)`` is called after each probe."""

    def __init__(self, config, gpus: int, global_batch: int, disk=None, on_probe=None):
        self.config, self.gpus, self.global_batch = config, gpus, global_batch
        device = get_device(config.gpu)
        self.capacity = device.capacity_reported
        # the peak in the matmuls' dtype (a torchtitan job's: its mixed precision's)
        self.peak_flops = device.matmul_peak(compute_dtype(config) if is_torchtitan(config.target)
                                             else config.amp or config.dtype)
        self.facts, self.model = model_facts(replace(config, mesh=None, parallelize=None, pp_split=None))
        self.titan = is_torchtitan(config.target)  # torchtitan's config decides its checkpointing and loss
        # the pipeline schedule: a torchtitan job's own (fxacct.parallel.torchtitan_pipeline), or --pp-schedule
        self.schedule = titan_schedule(config) if self.titan else config.pp_schedule
        self.ckpt = () if self.titan else \
            config.checkpoint or ((f"{self.facts.container}.*",) if self.facts.container else ())
        self.cache: dict[tuple, Point | PipePoint] = {}
        self.disk, self.on_probe = disk, on_probe
        self.ran = 0  # traces run (or begun) by this planner, not found in memory or on disk
        self.failed: set = set()  # the keys of traces that raised: a layout the model cannot run
        self.probes: list[Probe] = []

    def layout_config(self, lay: Layout):
        if self.titan:  # --batch is torchtitan's local batch: a pipeline's M micro-batches together
            batch = lay.micro_batch * (lay.accumulation if lay.pp > 1 else 1)
            return replace(self.config, mesh=lay.mesh, batch=batch, find_max_batch=False,
                           microbatches=lay.accumulation if lay.pp > 1 else None)
        # a --parallelize function shards over fsdp and tp: a pipeline alone has nothing for it
        parallelize = self.config.parallelize if lay.fsdp > 1 or lay.tp > 1 else None
        return replace(self.config, mesh=lay.mesh, batch=lay.micro_batch, find_max_batch=False, parallelize=parallelize,
                       checkpoint=self.ckpt if lay.checkpoint else (),
                       checkpoint_policy=self.config.checkpoint_policy if lay.checkpoint else None,
                       microbatches=lay.accumulation if lay.pp > 1 else None,
                       pp_split=self.config.pp_split if lay.pp > 1 else None)

    def _cached(self, cfg, part, run):
        key = (repr(cfg), part)
        if key in self.cache:
            return self.cache[key]
        got = self.disk.get(cfg, part) if self.disk is not None else None
        if got is None:
            self.ran += 1  # before it runs: a trace that raises (a usage error of the layout) was run too
            try:
                got = run()
            except Exception:
                self.failed.add(key)
                raise
            collect_dropped()  # the trace's graph, kept of it only its numbers (fxacct.heap)
            if self.disk is not None:
                self.disk.put(cfg, part, got)
        self.cache[key] = got
        return got

    def _trace(self, cfg, loader) -> Point:
        blocks = getattr(loader, "blocks", None)
        if self.titan:
            return self._cached(cfg, ("point", None), lambda: point(profile_torchtitan(cfg)))
        return self._cached(cfg, ("point", blocks),
                            lambda: point(profile_parallel(cfg, loader, with_inference=False)))

    def _pipeline(self, cfg, loader) -> PipePoint:
        blocks = getattr(loader, "blocks", None)
        # a full trace is replayed through the allocator unless over memory at its peak; a screen's never
        capacity = self.capacity if loader is None else 0
        if self.titan:
            return self._cached(cfg, ("pipe", None), lambda: pipe_point(profile_torchtitan_pipeline(cfg), capacity))
        return self._cached(cfg, ("pipe", blocks), lambda: pipe_point(
            profile_pipeline(cfg, loader, reuse_stages=True) if loader else profile_pipeline(cfg, reuse_stages=True),
            capacity))

    def probe(self, lay: Layout, full: bool = False) -> Candidate:
        """The layout's account: screened, or ``full``: one trace of the whole model."""
        ran, start = self.ran, time.perf_counter()
        c = self._probe(lay, full)
        # a rejected layout's exception holds its trace through its traceback: freed once handled
        collect_dropped()
        p = Probe(c, "traced" if self.ran > ran else "reused", time.perf_counter() - start)
        self.probes.append(p)
        if self.on_probe is not None:
            self.on_probe(p)
        return c

    def _probe(self, lay: Layout, full: bool) -> Candidate:
        cfg = self.layout_config(lay)
        blocks = self.facts.blocks
        try:
            if self.titan:  # torchtitan builds the whole job: no truncated screen, a full trace each
                return self._pipeline_candidate(lay, self._pipeline(cfg, None), "traced") if lay.pp > 1 \
                    else self._candidate(lay, self._trace(cfg, None), "traced")
            if lay.pp > 1:  # the screen only rejects: its peak, a lower bound, can be far below a pipeline's
                # (a stage that keeps its blocks' gathered weights between micro-batches grows by them at a
                # moment that is not the peak at 3 or 4 blocks a stage)
                if not full and pipeline_screens(blocks, lay.pp):
                    c = self._pipeline_candidate(lay, screen_pipeline(cfg, blocks, lay.pp, self._pipeline), "screen")
                    if c.over_memory or c.rejected:
                        return c
                return self._pipeline_candidate(lay, self._pipeline(cfg, None), "traced")
            if full:
                return self._candidate(lay, self._trace(cfg, None), "traced")
            source = "traced" if blocks <= SCREEN_BLOCKS + 1 else "screen"
            return self._candidate(lay, screen(cfg, blocks, self._trace), source)
        except UsageError as e:  # no plan for tp, an optimizer that cannot step on the shards, ...
            return Candidate(lay, rejected=str(e))
        except FxacctError as e:
            return Candidate(lay, rejected=f"the model failed: {e}")

    def _candidate(self, lay: Layout, p: Point, source: str) -> Candidate:
        a = lay.accumulation
        kept = p.grad_bytes if a > 1 else 0  # the gradients accumulate across the micro-steps
        # a micro-steps of forward and backward, then one optimizer step
        step = a * (p.step_s - p.optimizer_s) + p.optimizer_s
        return self._judge(lay, (p.peak_bytes + kept, p.fit_bytes + kept), step, p.tokens_per_example,
                           a * p.model_flops, source)

    def _pipeline_candidate(self, lay: Layout, pipe: PipePoint, source: str) -> Candidate:
        if not pipe.timed:
            return Candidate(lay, rejected="pp without fsdp or tp: plan times a stage as a rank of a mesh")
        a = lay.accumulation
        # the stage peaks replay all M micro-batches in the schedule's order, the gradients kept
        # from the first backward included (fxacct.parallel.pipeline_memory): nothing to add.
        # Each rank works M micro-steps and idles the bubble's share of the step (from the schedule's
        # own order): M × its micro-step ÷ (1 − bubble), the slowest rank's ((M + P − 1) × the
        # slowest micro-step for GPipe and 1F1B), then one optimizer step, the slowest rank's
        step = max(a * (s - o) for s, o in zip(pipe.step_s, pipe.optimizer_s)) / (1 - pipe.bubble_fraction) + \
            max(pipe.optimizer_s)
        return self._judge(lay, (pipe.peak_bytes, pipe.fit_bytes), step, pipe.tokens_per_example,
                           a * sum(pipe.model_flops), source, len(pipe.model_flops), pipe.fit_is_bound)

    def _judge(self, lay, memory: tuple[int, int], step_s: float, tokens: int, flops: int, source: str,
               ranks: int = 1, bound: bool = False) -> Candidate:
        """``memory``: (the peak, what the rank needs of the GPU: judged against its capacity; a lower
        bound from the screen, or where ``bound``); ``flops``: the step's over ``ranks`` GPUs (a
        pipeline's stages), for MFU a GPU's share."""
        peak, need = memory
        c = Candidate(lay, peak, step_s, self.global_batch * tokens / step_s if tokens else None,
                      flops / ranks / step_s / self.peak_flops, source, model_flops=flops, fit_bytes=need)
        if need > self.capacity:
            least = " at least" if source == "screen" or bound else ""
            return replace(c, rejected=f"over memory by{least} {format_bytes(need - self.capacity)} "
                                       f"({need / self.capacity:.2f}×)", over_bytes=need - self.capacity)
        return c


__all__ = ["Candidate", "Planner", "Probe"]
