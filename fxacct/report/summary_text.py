"""The one-screen summary that opens `fxacct profile` (and is all of `--summary`): FLOPs, parameters,
the training peak and its biggest parts, fit and largest batch, predicted step time and tokens/s,
and what fxacct could not cost. At most ~15 lines; the same facts feed the markdown summary."""

from __future__ import annotations

import textwrap

from fxacct.devices import get_device
from fxacct.dtypes import dtype_name
from fxacct.report.durations import format_ms
from fxacct.step import Profile
from fxacct.units import format_bytes, format_count

TOP_CATEGORIES = 3  # the peak's biggest parts shown in the summary


def exact_count(n: int) -> str:
    """'124.440M (124,439,808)', or '15' when the short form is already exact."""
    short = format_count(n)
    return short if short.replace(",", "") == str(n) else f"{short} ({n:,})"


def exact_bytes(n: int) -> str:
    """'6.49 GiB (6,972,663,156 B)', or '360 B' when that is already exact."""
    short = format_bytes(n)
    return short if short == f"{n} B" else f"{short} ({n:,} B)"


def fit_verdict(headroom_bytes: int) -> str:
    """'fits, 12.30 GiB headroom' or 'DOES NOT FIT, 69.20 PiB short': the unit by magnitude."""
    if headroom_bytes >= 0:
        return f"fits, {format_bytes(headroom_bytes)} headroom"
    return f"DOES NOT FIT, {format_bytes(-headroom_bytes)} short"


def _precision(p: Profile) -> str:
    c = p.config
    if c.amp is not None:
        return f"autocast {dtype_name(c.amp)}"
    return dtype_name(c.dtype) if c.dtype is not None else "model dtypes"


def facts(p: Profile, prediction=None) -> list[tuple[str, str]]:
    """(label, text) pairs, in reading order: the summary as data, for text and markdown alike.
    Under pp the account is stage 0's for one micro-batch, and the lines say so; the peak and fit
    are the ranks' over the whole step (the schedule's micro-batches in flight)."""
    c, t = p.config, p.accounting.totals
    pipe = _pipeline(p)
    fb = t.forward.total + t.backward.total
    flops = (f"{format_count(fb)} {'per micro-batch of stage 0' if pipe else 'per step'} = forward "
             f"{format_count(t.forward.total)} + backward {format_count(t.backward.total)}; "
             f"{format_count(fb // c.batch)} per example")
    if t.tokens_per_example:
        flops += f", {format_count(fb // (c.batch * t.tokens_per_example))} per token"
    batch = f"micro-batch {c.batch} × {pipe.microbatches} per step ({pipe.schedule})" if pipe else f"batch {c.batch}"
    rows = [("config", batch
                       + (f" × {c.world_size} ranks ({c.shard})" if c.world_size > 1 and c.mesh is None else "")
                       + (f" per rank, mesh {c.mesh}" if c.mesh is not None else "")
                       + (f", sequence {t.tokens_per_example}" if t.tokens_per_example else "")
                       + f", {_precision(p)}, {c.optimizer}, loss {c.loss}"),
            ("FLOPs", flops),
            ("parameters", _parameters(p, pipe))]
    memory = _memory_facts(p)
    rows += memory if pipe is None else [(k, _pipeline_memory(k, v, p, pipe)) for k, v in memory]
    rows += _time_facts(p, prediction)
    rows.append(("uncosted", _uncosted(p)))
    return rows


def _parameters(p: Profile, pipe=None) -> str:
    """The parameter count; under --mesh rank 0's shard, said so, beside the whole model's (under
    an interleaved pipeline rank 0's shards of each of its stages, summed)."""
    t, par = p.accounting.totals, p.parallel
    text = (f"{exact_count(t.params)}"
            + (f", trainable {exact_count(t.trainable_params)}" if t.trainable_params != t.params else "")
            + f"; {format_bytes(t.param_bytes)}")
    if par is None:
        return text
    whole = f"; the whole model {exact_count(par.model_params)}" if par.model_params else ""
    if pipe is not None and pipe.stages_per_rank > 1:
        first = pipe.stages[0]
        stages = ", ".join(map(str, first.stages_on_rank))
        return (f"per rank (rank 0's shards of stages {stages}) {exact_count(first.params)}; "
                f"{format_bytes(first.param_bytes)}{whole}")
    return f"per rank (rank 0's shard) {text}{whole}"


def _pipeline(p: Profile):
    return p.parallel.pipeline if p.parallel is not None else None


def _pipeline_memory(label: str, text: str, p: Profile, pipe) -> str:
    """The peak and fit lines of a pipeline: the ranks' over the step, not stage 0's one micro-batch."""
    first, worst = pipe.stages[0], pipe.peak_bytes
    if label == "peak":
        return (f"training step, rank 0 {exact_bytes(first.peak_bytes)} ({first.in_flight} micro-batches in "
                f"flight); the largest rank's {format_bytes(worst)}; one micro-batch of stage 0: "
                f"{format_bytes(p.memory.rank_peak.bytes)}")
    if label == "fit" and p.memory.fit is not None:
        f = p.memory.fit  # the largest rank's step through the allocator on a CUDA target (fxacct.api._pipeline)
        what = f"the largest rank's peak reserved + fixed {format_bytes(f.peak_bytes)}" \
            if p.memory.reserved is not None else "the largest rank's peak"
        return f"{fit_verdict(f.headroom_bytes)} of {format_bytes(f.capacity_bytes)} on {f.gpu} ({what})"
    return text


def _memory_facts(p: Profile) -> list[tuple[str, str]]:
    m, c = p.memory, p.config
    rows = []
    pk = m.rank_peak
    if pk is not None:
        parts = sorted(((b, cat) for cat, b in pk.by_category if b), reverse=True)[:TOP_CATEGORIES]
        where = f"training step, per rank ({c.shard})" if m.per_rank is not None else "training step"
        rows.append(("peak", f"{where} {exact_bytes(pk.bytes)} at {pk.node or 'start'} ({pk.phase}): "
                             + ", ".join(f"{cat.replace('_', ' ')} {format_bytes(b)}" for b, cat in parts)))
    if m.reserved is not None:
        rows.append(("reserved", reserved_fact(m.reserved, per_rank=p.parallel is not None or m.per_rank is not None)))
    if m.peak_inference is not None:
        rows.append(("inference", f"peak {format_bytes(m.peak_inference.bytes)} (eval, no_grad)"))
    if m.fit is not None:
        f = m.fit
        text = f"{fit_verdict(f.headroom_bytes)} of {format_bytes(f.capacity_bytes)} on {f.gpu}"
        if f.basis != "peak_train_bytes":
            text += f" ({f.basis.replace('_bytes', '').replace('_', ' ')} {format_bytes(f.peak_bytes)})"
        if f.max_batch is not None:
            text += f"; largest batch {f.max_batch}" + ("" if f.max_batch_verified else " (estimate)")
        rows.append(("fit", text))
    elif c.gpu is None:
        rows.append(("fit", "give --gpu NAME for fit and the largest batch"))
    return rows


def reserved_fact(r, per_rank: bool = False) -> str:
    """'peak reserved 1.05 GiB (allocated 1.02 GiB) + fixed 400.00 MiB outside the allocator (...)'."""
    outside = [f for f in r.fixed if not f.inside_reserved]
    inside = [f for f in r.fixed if f.inside_reserved]
    conf = f", {r.alloc_conf}" if r.alloc_conf else ""
    text = (f"{'per rank: ' if per_rank else ''}peak {format_bytes(r.peak_reserved_bytes)} as the CUDA caching allocator "
            f"holds it{conf} (allocated {format_bytes(r.peak_allocated_bytes)}); fixed {format_bytes(r.fixed_outside_bytes)} "
            "outside it: " + ", ".join(f"{f.name} {format_bytes(f.bytes)}" for f in outside))
    if inside:
        text += "; inside it: " + ", ".join(f"{f.name} {format_bytes(f.bytes)}" for f in inside)
    if r.oom_events:
        text += f"; OUT OF MEMORY at {r.oom_events} allocation{'s' if r.oom_events > 1 else ''}"
    return text


def _rate(x: float) -> str:
    return f"{x:.3g}" if x < 100 else format_count(round(x))


def _mesh_time(p: Profile, prediction) -> str:
    """--mesh with --gpu: rank 0's critical path of compute and communication (the roofline's
    single stream would time the collectives as local copies)."""
    par = p.parallel
    t, th = par.time, par.throughput
    where = prediction.device.name if prediction is not None else p.config.gpu
    scope = " for one micro-batch of stage 0" if par.pipeline is not None else ""
    text = (f"{format_ms(1e3 * t.step_s)}{scope} predicted on {where} (compute and communication on their streams, "
            f"{format_ms(1e3 * t.exposed_comm_s)} of communication exposed)")
    if th.tokens_per_s_gpu is not None:
        text += f"; {_rate(th.tokens_per_s_gpu)} tokens/s per GPU, {_rate(th.tokens_per_s_job)} for the job"
    return text


def _pipeline_time(p: Profile, pipe) -> str:
    """--mesh pp=P with a device model: the whole step, every micro-batch through the schedule."""
    c, t = p.config, p.accounting.totals
    where = get_device(c.gpu).name if c.gpu else "this CPU"  # the name every other step time gives
    text = (f"{format_ms(1e3 * pipe.step_s)} predicted on {where}, the whole step: {pipe.microbatches} micro-batches "
            f"through {len(pipe.stages) * pipe.stages_per_rank} stages ({pipe.schedule}, roofline; sends and the "
            "collectives inside a stage not on it)")
    if t.tokens_per_example and pipe.step_s > 0:
        pipeline_tokens = c.batch * pipe.microbatches * t.tokens_per_example
        text += f"; {_rate(pipeline_tokens / pipe.step_s)} tokens/s per pipeline"
    return text


def _time_facts(p: Profile, prediction) -> list[tuple[str, str]]:
    pipe = _pipeline(p)
    if pipe is not None and pipe.step_s is not None:
        return [("step time", _pipeline_time(p, pipe))]
    if p.parallel is not None and p.parallel.time is not None:
        return [("step time", _mesh_time(p, prediction))]
    if prediction is None:
        return [("step time", "not predicted (run `fxacct calibrate --device cpu`, or give --gpu NAME)")]
    c, t = p.config, p.accounting.totals
    if _pipeline(p) is not None:  # the roofline of stage 0's one micro-batch: no pipeline step, no throughput
        return [("step time", f"{format_ms(prediction.step_ms)} for one micro-batch of stage 0 predicted on "
                              f"{prediction.device.name} (roofline)")]
    text = f"{format_ms(prediction.step_ms)} predicted on {prediction.device.name} (roofline)"
    step_s = prediction.step_s
    if t.tokens_per_example and step_s > 0:
        per_rank = c.batch * t.tokens_per_example / step_s
        text += f"; {_rate(per_rank)} tokens/s"
        if c.world_size > 1:
            text += f" per rank, {_rate(per_rank * c.world_size)} over {c.world_size}"
    elif step_s > 0:
        text += f"; {_rate(c.batch / step_s)} examples/s"
    return [("step time", text)]


def uncosted_ops(p: Profile) -> tuple[int, str] | None:
    """(op nodes without a cost formula, "op ×n, ...") or None when every op has one."""
    a = p.accounting
    if not a.unsupported_ops:
        return None
    return sum(a.unsupported_ops.values()), ", ".join(f"{op} ×{n}" for op, n in a.unsupported_ops.items())


def _uncosted(p: Profile) -> str:
    n = p.accounting.node_count
    missing = uncosted_ops(p)
    if missing is None:
        return f"nothing: every op has a cost formula ({n:,} op nodes)"
    return f"WARNING {missing[0]} of {n:,} op nodes, FLOPs not counted: {missing[1]}"


def render_summary(p: Profile, prediction=None, width: int | None = None) -> str:
    """The facts as 'label  text' lines, wrapped to ``width`` under their text (None: no limit)."""
    pairs = facts(p, prediction)
    label = max(len(k) for k, _ in pairs)
    lines = [f"fxacct profile: {p.title}"]
    for k, v in pairs:
        line = f"  {k.ljust(label)}  {v}"
        if width is None or len(line) <= width:
            lines.append(line)
        else:
            lines += textwrap.wrap(line, width=width, subsequent_indent=" " * (label + 4), break_on_hyphens=False)
    return "\n".join(lines)


__all__ = ["facts", "render_summary", "exact_count", "exact_bytes", "fit_verdict", "reserved_fact"]
