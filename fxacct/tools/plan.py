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

from dataclasses import dataclass, replace

from fxacct.api import profile
from fxacct.devices import get_device
from fxacct.errors import FxacctError, UsageError
from fxacct.heap import with_frozen_heap
from fxacct.parallel.profile import profile_parallel
from fxacct.tools.plan_layouts import Layout, enumerate_layouts, exact_rejection, model_facts
from fxacct.tools.plan_screen import SCREEN_BLOCKS, Point, point, screen
from fxacct.units import format_bytes


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    peak_bytes: int | None = None  # per rank, for the whole step
    step_s: float | None = None
    tokens_per_s: float | None = None  # the job's
    mfu: float | None = None
    source: str = "-"  # "traced" (a full trace), "screen" (extrapolated), "-" (no trace of its own)
    rejected: str | None = None  # why it does not fit or cannot run, None if it does
    dominated: str | None = None  # fits, but a layout of its group is faster (not traced)
    over_bytes: int | None = None  # peak − capacity when over memory (a lower bound from the screen)

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
class PlanResult:
    candidates: tuple[Candidate, ...]  # the fitting ones by throughput, then the rest
    traces: int  # traces run (screen and confirmation)
    blocks: int  # the model's repeated blocks


class Planner:
    """The search of one ``plan`` call, with its cache of traces (one per distinct per-rank shape:
    mesh, micro-batch, checkpointing and block count)."""

    def __init__(self, config, gpus: int, global_batch: int):
        self.config, self.gpus, self.global_batch = config, gpus, global_batch
        device = get_device(config.gpu)
        self.capacity = device.capacity_reported
        self.peak_flops = device.matmul_peak(config.amp or config.dtype)
        self.facts, self.model = model_facts(replace(config, mesh=None, parallelize=None, pp_split=None))
        self.ckpt = config.checkpoint or ((f"{self.facts.container}.*",) if self.facts.container else ())
        self.cache: dict[tuple, object] = {}

    def layout_config(self, lay: Layout):
        # a --parallelize function shards over fsdp and tp: a pipeline alone has nothing for it
        parallelize = self.config.parallelize if lay.fsdp > 1 or lay.tp > 1 else None
        return replace(self.config, mesh=lay.mesh, batch=lay.micro_batch, find_max_batch=False, parallelize=parallelize,
                       checkpoint=self.ckpt if lay.checkpoint else (),
                       checkpoint_policy=self.config.checkpoint_policy if lay.checkpoint else None,
                       microbatches=lay.accumulation if lay.pp > 1 else None,
                       pp_split=self.config.pp_split if lay.pp > 1 else None)

    def _trace(self, cfg, loader) -> Point:
        key = (cfg.mesh, cfg.batch, cfg.checkpoint, getattr(loader, "blocks", None))
        if key not in self.cache:
            self.cache[key] = point(profile_parallel(cfg, loader, with_inference=False))
        return self.cache[key]

    def _pipeline(self, cfg):
        key = (cfg.mesh, cfg.batch, cfg.checkpoint, cfg.microbatches)
        if key not in self.cache:
            self.cache[key] = profile(cfg).parallel.pipeline
        return self.cache[key]

    def probe(self, lay: Layout, full: bool = False) -> Candidate:
        """The layout's account: screened, or ``full``: one trace of the whole model."""
        cfg = self.layout_config(lay)
        try:
            if lay.pp > 1:
                return self._pipeline_candidate(lay, self._pipeline(cfg))
            if full:
                return self._candidate(lay, self._trace(cfg, None), "traced")
            source = "traced" if self.facts.blocks <= SCREEN_BLOCKS + 1 else "screen"
            return self._candidate(lay, screen(cfg, self.facts.blocks, self._trace), source)
        except UsageError as e:  # no plan for tp, an optimizer that cannot step on the shards, ...
            return Candidate(lay, rejected=str(e))
        except FxacctError as e:
            return Candidate(lay, rejected=f"the model failed: {e}")

    def _candidate(self, lay: Layout, p: Point, source: str) -> Candidate:
        a = lay.accumulation
        peak = p.peak_bytes + (p.grad_bytes if a > 1 else 0)
        # a micro-steps of forward and backward, then one optimizer step
        step = a * (p.step_s - p.optimizer_s) + p.optimizer_s
        return self._judge(lay, peak, step, p.tokens_per_example, a * p.model_flops / step, source)

    def _pipeline_candidate(self, lay: Layout, pipe) -> Candidate:
        stages = pipe.stages
        if any(s.profile.parallel is None or s.profile.parallel.time is None for s in stages):
            return Candidate(lay, rejected="pp without fsdp or tp: plan times a stage as a rank of a mesh")
        a = lay.accumulation
        # the stage peaks replay all M micro-batches in the schedule's order, the gradients kept
        # from the first backward included (fxacct.parallel.pipeline_memory): nothing to add
        peak = pipe.peak_bytes
        # each rank works M micro-steps and idles the bubble's share of the step (from the schedule's
        # own order): M × its micro-step ÷ (1 − bubble), the slowest rank's ((M + P − 1) × the
        # slowest micro-step for GPipe and 1F1B), then one optimizer step, the slowest rank's
        times = [s.profile.parallel.time for s in stages]
        step = max(a * (t.step_s - t.optimizer_s) for t in times) / (1 - pipe.bubble_fraction) + \
            max(t.optimizer_s for t in times)
        flops = a * sum(s.profile.accounting.totals.model_flops for s in stages) / len(stages) / step
        tokens = stages[0].profile.accounting.totals.tokens_per_example or 0
        return self._judge(lay, peak, step, tokens, flops, "traced")

    def _judge(self, lay, peak: int, step_s: float, tokens: int, flops_per_s: float, source: str) -> Candidate:
        c = Candidate(lay, peak, step_s, self.global_batch * tokens / step_s if tokens else None,
                      flops_per_s / self.peak_flops, source)
        if peak > self.capacity:
            least = " at least" if source == "screen" else ""  # the screen's peak is a lower bound
            return replace(c, rejected=f"over memory by{least} {format_bytes(peak - self.capacity)} "
                                       f"({peak / self.capacity:.2f}×)", over_bytes=peak - self.capacity)
        return c


def _others(group: list[Layout], probed: dict) -> dict:
    """The untraced layouts of a group: below the largest that fits (slower), above one over
    memory (over too), or, where the group failed, the same reason."""
    fit = max((lay.micro_batch for lay, c in probed.items() if c.fits), default=None)
    over = min((c for c in probed.values() if c.over_memory), key=lambda c: c.micro_batch, default=None)
    failed = next((c for c in probed.values() if c.rejected and not c.over_memory), None)
    out = {}
    for lay in group:
        if lay in probed:
            continue
        if fit is not None and lay.micro_batch < fit:
            out[lay] = Candidate(lay, dominated=f"slower than mb {fit}")
        elif over is not None and lay.micro_batch > over.micro_batch:
            out[lay] = Candidate(lay, rejected=f"over memory (mb {over.micro_batch} is, by "
                                               f"{'≥ ' if over.source == 'screen' else ''}"
                                               f"{format_bytes(over.over_bytes)})")
        elif failed is not None:
            out[lay] = Candidate(lay, rejected=f"as mb {failed.micro_batch}: {failed.rejected}")
    return out


def _bisect(planner: Planner, group: list[Layout], probed: dict) -> None:
    """group[0] fits and group[-1] does not: the largest fitting micro-batch between them."""
    lo, hi = 0, len(group) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        c = probed[group[mid]] = planner.probe(group[mid])
        if c.fits:
            lo = mid
        elif c.over_memory:
            hi = mid
        else:
            return


def _search_group(planner: Planner, group: list[Layout]) -> dict:
    """Every layout of a group (by micro-batch): micro-batch 1 first (over memory: all are), then
    the largest, then bisection between them; a pipeline's upwards from 1."""
    probed = {group[0]: planner.probe(group[0])}
    if group[0].pp > 1:  # the bubble shrinks with more micro-batches: every one that fits is traced,
        # upwards until one does not (a larger one holds more; its M = share ÷ mb is smaller still)
        for prev, lay in zip(group, group[1:]):
            if not probed[prev].fits:
                break
            probed[lay] = planner.probe(lay)
    elif probed[group[0]].fits and len(group) > 1:
        top = probed[group[-1]] = planner.probe(group[-1])
        if top.over_memory:
            _bisect(planner, group, probed)
    fit = max((lay.micro_batch for lay, c in probed.items() if c.fits), default=0)
    slower = {} if group[0].pp > 1 else {lay: replace(c, dominated=f"slower than mb {fit}")
                                         for lay, c in probed.items() if c.fits and lay.micro_batch < fit}
    return {**probed, **slower, **_others(group, probed)}


def _groups(planner: Planner, layouts: list[Layout]) -> tuple[dict, dict]:
    """({layout: Candidate} rejected before tracing, one row per mesh; {group: its layouts by micro-batch})."""
    out, groups, meshes = {}, {}, {}
    for lay in layouts:
        key = (lay.pp, lay.fsdp, lay.tp)
        if key not in meshes:
            meshes[key] = exact_rejection(lay, planner.facts, planner.model, planner.gpus, planner.global_batch,
                                          planner.capacity)
            if meshes[key]:  # no reason depends on the micro-batch or checkpointing: one row per mesh
                row = replace(lay, micro_batch=0, accumulation=0, checkpoint=False)
                out[row] = Candidate(row, rejected=meshes[key])
        if meshes[key]:
            continue
        few = _too_few_microbatches(lay, planner.config.pp_schedule)
        if few:
            out[lay] = Candidate(lay, rejected=few)
        else:
            groups.setdefault(lay.group, []).append(lay)
    return out, groups


def _too_few_microbatches(lay: Layout, schedule: str) -> str | None:
    """A pipeline layout whose step has fewer micro-batches than 1F1B has stages (torch's
    Schedule1F1B refuses it), said in the plan's own terms: the planner, not the user, chose M."""
    if lay.pp > 1 and schedule == "1f1b" and lay.accumulation < lay.pp:
        return (f"{lay.accumulation} micro-batch{'es' if lay.accumulation > 1 else ''} per step, fewer than the "
                f"{lay.pp} stages 1F1B needs (a smaller micro-batch makes more)")
    return None


def search(planner: Planner, layouts: list[Layout]) -> dict:
    """{layout: Candidate} for every layout (the search of the module docstring, steps 1-3). A
    mesh's group without checkpointing goes first: where it fits at a micro-batch, checkpointing
    at that micro-batch only adds time (the recompute)."""
    out, groups = _groups(planner, layouts)
    for g in sorted(groups, key=lambda g: (g[0], g[2], g[3])):
        lays = groups[g]
        off = {lay.micro_batch for lay, c in out.items() if lay.group == g[:3] + (False,) and c.fits}
        if g[3] and off and g[0] == 1:
            got = {lay: Candidate(lay, dominated=f"slower than ckpt off at mb {max(off)}") for lay in lays
                   if lay.micro_batch <= max(off)}
            rest = [lay for lay in lays if lay.micro_batch > max(off)]
            got.update(_search_group(planner, rest) if rest else {})
        else:
            got = _search_group(planner, lays)
        out.update(got)
    return out


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


@with_frozen_heap
def plan(config, gpus: int, global_batch: int, confirm_top: int = 1) -> PlanResult:
    """Every layout: the fitting ones by tokens/s (highest first), then those that fit but are
    slower than another micro-batch of theirs, then the rejected, in enumeration order."""
    if config.gpu is None:
        raise UsageError("fxacct plan needs --gpu NAME (capacity, peak FLOP/s and links)")
    check_job(gpus, global_batch)
    if confirm_top < 0:
        raise UsageError(f"--confirm must be 0 or more, got {confirm_top}")
    if config.pp_schedule == "interleaved-1f1b":  # a rank's account holds its first stage's time only
        raise UsageError("fxacct plan times --pp-schedule gpipe or 1f1b; profile an interleaved layout with "
                         "fxacct profile --mesh pp=P,... --pp-schedule interleaved-1f1b")
    planner = Planner(config, gpus, global_batch)
    # checkpointing on is a layout of its own only where there is something to checkpoint
    layouts = enumerate_layouts(gpus, global_batch, config.gpus_per_node, config.pp_split is not None,
                                checkpointing=bool(planner.ckpt))
    out = search(planner, layouts)
    confirm(planner, out, confirm_top)
    cands = sorted(out.values(), key=lambda c: (c.layout.pp, c.layout.tp, c.layout.checkpoint, c.layout.micro_batch))
    ranked = _ranked(cands)
    rest = [c for c in cands if c.dominated] + [c for c in cands if c.rejected]
    return PlanResult(tuple(ranked + rest), len(planner.cache), planner.facts.blocks)
