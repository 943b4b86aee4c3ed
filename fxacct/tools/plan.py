"""``fxacct plan``: the layouts of N GPUs (fxacct.tools.plan_layouts), ranked by predicted
throughput among those that fit, and why the others were rejected.

How a layout is judged, cheapest first:

1. Exact rejections before any trace (fxacct.tools.plan_layouts.exact_rejection; per layout, a
   pipeline with fewer micro-batches than 1F1B's stages).
2. The screen (fxacct.tools.plan_screen): one rank's account from two traces of the model cut to 3
   and 4 repeated blocks, extrapolated to all of them: FLOPs and bytes exact, the peak a lower
   bound (so "over memory" from the screen is a sound rejection, "fits" needs step 4). Pipeline
   layouts are traced in full (each stage one rank, fxacct.parallel.pipeline).
3. Within a group (the same pp, fsdp, tp and checkpointing), the per-rank peak grows with the
   micro-batch, and in the roofline model a micro-batch of A× the examples never takes more than
   A× the time (the weights' bytes do not grow with it; collectives and the optimizer step run
   once instead of A times). So micro-batch 1 is tried first (over memory: the whole group is),
   then the largest (it fits: the smaller ones are only slower), then the largest that fits is
   found by bisection. Without checkpointing first: where a mesh fits at a micro-batch without
   it, checkpointing at that micro-batch or below only adds the recompute. Pipeline groups are
   the exception: more micro-batches shrink the bubble, so every one that fits is traced.
4. The best layouts are confirmed by a full trace each (``confirm``), whose numbers replace the
   screen's; a layout that turns out not to fit is rejected and the next one confirmed.

A step of A micro-batches takes A × the traced micro-step's forward and backward plus one
optimizer step (mesh timing's ``optimizer_s``), and with A > 1 the rank's gradients are added to
the traced peak (they are kept between micro-batches; counted in full on top of the peak: an upper
bound). With pp the stage accounts already hold the whole step (fxacct.parallel.pipeline_memory
replays the M micro-batches in the schedule's order): the peak is the largest stage's, the step
M × the slowest stage's micro-step (its optimizer left out) ÷ (1 − the schedule's bubble),
(M + P − 1) × that micro-step for GPipe and 1F1B, then the slowest stage's optimizer step."""

from __future__ import annotations

import os
from dataclasses import dataclass

from fxacct.errors import UsageError
from fxacct.heap import with_frozen_heap
from fxacct.tools.plan_cache import TraceCache
from fxacct.tools.plan_layouts import enumerate_layouts
from fxacct.tools.plan_probe import Candidate, Planner, Probe
from fxacct.tools.plan_search import search
from fxacct.trace.checkpointing import matched_modules


@dataclass(frozen=True)
class PlanResult:
    candidates: tuple[Candidate, ...]  # the fitting ones by throughput, then the rest
    traces: int  # traces run or read from the cache (screen and confirmation), one per per-rank shape
    blocks: int  # the model's repeated blocks
    layouts: int = 0  # every layout enumerated
    traced: int = 0  # layouts probed with a trace of their own
    reused: int = 0  # layouts probed from traces already run (this plan's or, on disk, an earlier one's)
    pruned: int = 0  # layouts rejected before any trace (exact arguments, closed-form bounds)
    failed: int = 0  # traces that raised (a layout the model cannot run: its own rejection), one per per-rank shape


def _ranked(cands) -> list[Candidate]:
    """By tokens/s, highest first; equal to 9 digits (a screen and its full trace differ in float
    rounding only), the traced first."""
    return sorted((c for c in cands if c.fits), key=lambda c: (-float(f"{c.tokens_per_s or 0.0:.9g}"),
                                                                c.source != "traced"))


def confirm(planner: Planner, out: dict, n: int) -> None:
    """The top n fitting layouts traced in full (in place). The screen's peak is a lower bound
    (fxacct.tools.plan_screen), so one may turn out over memory: it is rejected, and the next
    smaller micro-batch of its group is traced in full in its place."""
    while True:
        pending = [c for c in _ranked(out.values())[:n] if c.source == "screen"]
        if not pending:
            return
        lay = pending[0].layout
        c = out[lay] = planner.probe(lay, full=True)
        while not c.fits and c.over_memory:
            smaller = [x for x in out if x.group == lay.group and x.micro_batch < lay.micro_batch]
            if not smaller:
                break
            lay = max(smaller, key=lambda x: x.micro_batch)
            c = out[lay] = planner.probe(lay, full=True)
        if c.fits and lay.pp == 1:
            out.update({x: Candidate(x, dominated=f"slower than mb {lay.micro_batch}") for x in out
                        if x.group == lay.group and x.micro_batch < lay.micro_batch})


def check_job(gpus: int, global_batch: int) -> None:
    if gpus < 2 or global_batch < 1:
        raise UsageError("--gpus must be at least 2 and --global-batch positive")


def default_jobs() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@with_frozen_heap
def plan(config, gpus: int, global_batch: int, confirm_top: int = 1, jobs: int = 1, cache_dir=None,
         on_probe=None) -> PlanResult:
    """Every layout: the fitting ones by tokens/s (highest first), then those that fit but are
    slower than another micro-batch of theirs, then the rejected, in enumeration order. ``jobs``:
    worker processes for the search (fxacct.tools.plan_search); ``cache_dir``: where traces are
    kept for reruns (fxacct.tools.plan_cache; None: in memory only); ``on_probe(Probe)``: called
    after each layout probed (the CLI's progress line)."""
    if config.gpu is None:
        raise UsageError("fxacct plan needs --gpu NAME (capacity, peak FLOP/s and links)")
    check_job(gpus, global_batch)
    if confirm_top < 0:
        raise UsageError(f"--confirm must be 0 or more, got {confirm_top}")
    if jobs < 1:
        raise UsageError(f"--jobs must be 1 or more, got {jobs}")
    if config.pp_schedule == "interleaved-1f1b":  # a rank's account holds its first stage's time only
        raise UsageError("fxacct plan times --pp-schedule gpipe or 1f1b; profile an interleaved layout with "
                         "fxacct profile --mesh pp=P,... --pp-schedule interleaved-1f1b")
    planner = Planner(config, gpus, global_batch, TraceCache(cache_dir) if cache_dir is not None else None, on_probe)
    if config.checkpoint:  # a pattern that matches nothing fails here, not in each layout that checkpoints
        matched_modules(planner.model, config.checkpoint)
    if not planner.titan and not config.input_requires_grad and \
            not any(p.requires_grad for p in planner.model.parameters()):
        raise UsageError("nothing in the model trains (no parameter requires grad), and fxacct plan lays out a "
                         "training step: profile it with fxacct profile --gpu NAME for its inference fit")
    # pipelines: where --pp-split says how to cut (a torchtitan job: its own cut, under a schedule
    # plan times, GPipe or 1F1B); checkpointing on is a layout of its own only where there is
    # something to checkpoint (a torchtitan job's is its config's)
    pipeline = planner.schedule in ("gpipe", "1f1b") if planner.titan else config.pp_split is not None
    layouts = enumerate_layouts(gpus, global_batch, config.gpus_per_node, pipeline,
                                checkpointing=None if planner.titan else bool(planner.ckpt))
    out, pruned = search(planner, layouts, jobs, cache_dir)
    confirm(planner, out, confirm_top)
    cands = sorted(out.values(), key=lambda c: (c.layout.pp, c.layout.tp, bool(c.layout.checkpoint), c.layout.micro_batch))
    ranked = _ranked(cands)
    rest = [c for c in cands if c.dominated] + [c for c in cands if c.rejected]
    probed = {}
    for p in planner.probes:  # a layout probed twice (screened, then confirmed) counts once, traced if either did
        lay = p.candidate.layout
        probed[lay] = "traced" if p.how == "traced" or probed.get(lay) == "traced" else p.how
    how = list(probed.values())
    return PlanResult(tuple(ranked + rest), len(planner.cache), planner.facts.blocks, len(layouts),
                      how.count("traced"), how.count("reused"), pruned, len(planner.failed - planner.cache.keys()))


__all__ = ["plan", "PlanResult", "Candidate", "Planner", "Probe", "check_job", "confirm", "default_jobs"]
