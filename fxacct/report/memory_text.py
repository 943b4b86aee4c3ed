"""The memory part of the human report: category × dtype, peaks and their composition, per rank,
fit on a GPU, checkpoint size, views vs copies."""

from __future__ import annotations

from fxacct.memory.peak import Peak
from fxacct.report.summary_text import fit_verdict
from fxacct.report.tables import tabulate
from fxacct.step import Profile
from fxacct.units import format_bytes

ROWS = (("parameters", "param_bytes"), ("gradients", "grad_bytes"), ("optimizer state", "optimizer_bytes"),
        ("master weights", "master_bytes"), ("activations (saved)", "activation_bytes"))


def category_table(p: Profile) -> str:
    m = p.memory
    dtypes = list(m.by_dtype)
    rows = []
    for label, field in ROWS:
        values = [getattr(m.by_dtype[d], field) for d in dtypes]
        if any(values):
            rows.append([label, *map(format_bytes, values), format_bytes(sum(values))])
    return tabulate(rows, headers=["memory", *dtypes, "total"], colalign=("left",) + ("right",) * (len(dtypes) + 1))


def _bytes(n: int) -> str:
    """'6.49 GiB (6,972,663,156 B)', or '360 B' when that is already exact."""
    short = format_bytes(n)
    return short if short == f"{n} B" else f"{short} ({n:,} B)"


def _composition(peak: Peak) -> str:
    return ", ".join(f"{c.replace('_', ' ')} {format_bytes(b)}" for c, b in peak.by_category if b)


def rule_of_thumb(p: Profile) -> str:
    """The lecture's 4·(P + A + G + O) next to the exact sum, and why they differ."""
    m = p.memory
    exact = m.param_bytes + m.activation_bytes + m.grad_bytes + m.optimizer_bytes + m.master_bytes
    count, scalar_bytes = m.optimizer_scalars
    line = (f"parameters + activations + gradients + optimizer state{' + master weights' if m.master_bytes else ''}"
            f" = {exact:,} B")
    if scalar_bytes:
        line += (f"; the per-parameter rule of thumb gives {exact - scalar_bytes:,} B: it leaves out the "
                 f"optimizer's {count} scalar step count{'s' if count != 1 else ''}, {scalar_bytes:,} B")
    return line


def render_memory(p: Profile) -> str:
    m, c = p.memory, p.config
    opt = c.optimizer if c.optimizer.lower() != "none" else "no optimizer"
    precision = (f"autocast {str(c.amp).removeprefix('torch.')}" if c.amp else
                 f"{str(c.dtype).removeprefix('torch.')}" if c.dtype else "model dtypes")
    lines = [f"memory of one training step ({opt}, {precision}{', fp32 master weights' if c.master_weights else ''}):",
             category_table(p), "", rule_of_thumb(p)]
    if m.peak_train is not None:
        pk = m.peak_train
        lines.append(f"peak, training step: {_bytes(pk.bytes)} at {pk.node or 'start'} "
                     f"({pk.phase}): {_composition(pk)}")
    if m.peak_inference is not None:
        pk = m.peak_inference
        lines.append(f"peak, inference (eval, no_grad): {_bytes(pk.bytes)} at "
                     f"{pk.node or 'start'}: {_composition(pk)}")
    if m.per_rank is not None:
        pk = m.per_rank
        unit = f"; gathered unit {m.gathered_unit[0]} {format_bytes(m.gathered_unit[1])}" if m.gathered_unit else ""
        lines.append(f"per rank, {c.shard} over {c.world_size} ranks: {_bytes(pk.bytes)}: "
                     f"{_composition(pk)}{unit}")
    lines.append("checkpoint (state_dict + optimizer state, tensor payload): " + format_bytes(m.checkpoint_bytes)
                 + " (" + ", ".join(f"{d} {format_bytes(b)}" for d, b in m.checkpoint_by_dtype.items()) + ")")
    v = m.views
    copies = "; ".join(f"{op.removeprefix('aten.')} ×{n} {format_bytes(b)}" for op, n, b in v.copies[:6]) or "none"
    views = (f"{v.view_nodes:,} view node{'s' if v.view_nodes != 1 else ''} allocate nothing (as copies they would take "
             f"{format_bytes(v.bytes_avoided)})" if v.view_nodes else "none")
    lines.append(f"forward views: {views}; copies: {copies}")
    if m.reserved is not None:
        r = m.reserved
        lines.append(f"reserved by the CUDA caching allocator (PYTORCH_CUDA_ALLOC_CONF {r.alloc_conf or 'unset'}): peak "
                     f"{_bytes(r.peak_reserved_bytes)} (" + ", ".join(f"{pool} pool, {stream} stream {format_bytes(b)}"
                                                               for pool, stream, b in r.by_pool_stream)
                     + f"); allocated at most {format_bytes(r.peak_allocated_bytes)}")
        lines += [f"fixed: {f.name} {format_bytes(f.bytes)}" + (" (inside reserved)" if f.inside_reserved else "")
                  + f" [{f.source}]" for f in r.fixed]
    if m.fit is not None:
        f = m.fit
        basis = "peak" if f.basis == "peak_train_bytes" else f.basis.replace("_bytes", "").replace("_", " ")
        lines.append(f"{f.gpu} ({format_bytes(f.capacity_bytes)} as the driver reports): per-rank {basis} "
                     f"{format_bytes(f.peak_bytes)}, {fit_verdict(f.headroom_bytes)}")
        if f.max_batch is not None:
            lines.append(f"largest batch that fits: {f.max_batch}"
                         + (f" (traced: {f.max_batch} fits, {f.max_batch + 1} does not)" if f.max_batch_verified else " (estimate: the search ran out of traces)"))
    return "\n".join(lines)
