"""The human report: summary, per-module table (--depth), top nodes by FLOPs (--top), and the
footer of ops fxacct could not cost."""

from __future__ import annotations

from fxacct.costs.registry import ATTENTION, FLOP_CLASSES, MATMUL, OTHER
from fxacct.dtypes import dtype_name
from fxacct.load.flags import DEFAULT_DEPTH, DEFAULT_TOP
from fxacct.report.checkpoint_text import checkpoint_section
from fxacct.report.collectives import render_collectives
from fxacct.report.compile_text import compile_section
from fxacct.report.memory_text import render_memory
from fxacct.report.runtime_text import predicted_section, runtime_headline, runtime_section
from fxacct.report.summary_text import render_summary, uncosted_ops
from fxacct.report.tables import tabulate
from fxacct.report.width import fit_table, wrap_lines
from fxacct.step import Profile
from fxacct.units import format_bytes, format_count

LOSS_TEXT = {"sum": "sum of outputs", "model": "the model's own loss is in its forward"}


def _flops(n: int) -> str:
    return format_count(n)


def _exact(n: int, fmt, unit: str = "") -> str:
    """'124.440M (124,439,808)', or just '15' when the short form is already exact."""
    short = fmt(n)
    exact = f"{n:,}{unit}"
    return short if short.replace(",", "") == exact.replace(",", "") else f"{short} ({exact})"


def summary(p: Profile) -> str:
    a, c, t = p.accounting, p.config, p.accounting.totals
    head = [
        f"in detail: batch {c.batch}" + (f", dtype {dtype_name(c.dtype)}" if c.dtype else "")
        + f", inputs {' '.join(a.input_shapes) or '-'}" + f", loss {c.loss}",
        f"  conventions: 1 multiply-add = 2 FLOPs; attention {c.causal_attention}"
        + (" (causal kernels halved)" if c.causal_attention == "halved" else " (no causal discount)")
        + ("; recompute counted" if c.count_recompute else "; no recompute")
        + "; GB = 1e9 B, GiB = 2^30 B",
        "",
    ]
    rows = []
    for cls in FLOP_CLASSES:
        f, b = getattr(t.forward, cls), getattr(t.backward, cls)
        rows.append([cls, _flops(f), _flops(b), _flops(f + b)])
    rows.append(["total", _flops(t.forward.total), _flops(t.backward.total),
                 _flops(t.forward.total + t.backward.total)])
    flops_table = tabulate(rows, headers=["FLOPs", "forward", "backward", "forward+backward"],
                           colalign=("left", "right", "right", "right"))
    lines = head + [flops_table, ""]
    lines.append(f"loss FLOPs ({LOSS_TEXT.get(c.loss, c.loss)}, not in the totals above): {_flops(t.loss_flops)}")
    if t.recompute_flops:
        lines.append(f"recomputed by activation checkpointing in the backward: {_flops(t.recompute_flops)} FLOPs, "
                     + ("in the backward above (hardware FLOPs: --count-recompute)" if c.count_recompute
                        else "not in the backward above (model FLOPs; --count-recompute adds them)"))
    lines.append(f"parameters: {_exact(t.params, format_count)}; trainable {_exact(t.trainable_params, format_count)}"
                 f"; {format_bytes(t.param_bytes)}; gradients {format_bytes(t.grad_bytes)}")
    by_loss = f"; the loss's {format_bytes(t.loss_activation_bytes)} of them" if t.loss_activation_bytes else ""
    lines.append(f"activations saved for backward: {_exact(t.activation_bytes, format_bytes, ' B')}{by_loss}")
    per_example = (t.forward.total + t.backward.total) // c.batch
    lines.append(f"FLOPs per example (forward+backward): {_flops(per_example)}")
    if t.tokens_per_example:
        tokens = c.batch * t.tokens_per_example
        lines.append(f"FLOPs per token: {_flops((t.forward.total + t.backward.total) // tokens)} "
                     f"({t.tokens_per_example} tokens per example)")
        lines.append(_six_n_d(p, tokens))
    return "\n".join(lines)


def _six_n_d(p: Profile, tokens: int) -> str:
    """6·N·D beside the exact model FLOPs. Under --mesh a rank holds a shard of N but works on the
    whole model for its batch, tensor parallelism aside: N is the model's, and the exact figure
    is the rank's × tp (a tp group's work on one batch)."""
    t, par = p.accounting.totals, p.parallel
    n, exact, whose, frozen = t.params, t.model_flops, "", t.params - t.trainable_params
    if par is not None and par.model_params:
        tp_size = par.mesh.size("tp")
        n, exact, frozen = par.model_params, t.model_flops * tp_size, par.model_frozen_params
        whose = f" of a tp group (rank's × {tp_size})" if tp_size > 1 else ""
        pipe = par.pipeline
        if pipe is not None:  # the report is stage 0's micro-batch; N is the whole model's: every stage's work
            if pipe.stages_per_rank > 1:  # a rank's account holds its first stage alone
                return (f"6·N·D rule of thumb: {_flops(6 * n * tokens)} (N={n:,}, D={tokens:,}); the exact "
                        "matmul+attention FLOPs are per stage (the pipeline table)")
            exact = tp_size * sum(st.profile.accounting.totals.model_flops for st in pipe.stages)
            whose = " of every stage" + (f" (× tp {tp_size})" if tp_size > 1 else "")
    six = 6 * n * tokens
    frozen = (f"; N counts all parameters, {frozen:,} of them frozen (their "
              "weight gradients are not computed)" if frozen else "")
    return (f"6·N·D rule of thumb: {_flops(six)} (N={n:,}, D={tokens:,}); exact matmul+attention{whose} "
            f"{_flops(exact)}; exact / 6ND = {exact / six:.3f}{frozen}")


def modules_table(p: Profile, depth: int, width: int | None = None) -> str:
    t = p.accounting.totals
    grand = max(1, t.forward.total + t.backward.total)
    rows = []
    for m in p.accounting.modules:
        if m.depth > depth:
            continue
        total = m.forward.total + m.backward.total
        name = ("  " * (m.depth - 1) + m.module) if m.module else "(root)"
        rows.append([name, _flops(m.forward.total), _flops(m.backward.total), _flops(total),
                     f"{100 * total / grand:.1f}%", format_bytes(m.activation_bytes)])
    return fit_table(["module", "forward", "backward", "total", "share", "activations"], rows, width,
                     text_columns=(0,), optional=(4,))


def nodes_table(p: Profile, top: int, width: int | None = None) -> str:
    nodes = sorted(p.accounting.nodes, key=lambda n: -(n.forward.total + n.backward.total))[:top]
    rows = [[n.name, n.op.removeprefix("aten.").removesuffix(".default"), n.module or "(root)",
             "x".join(map(str, n.shape)),
             n.dtype or "", n.kind, _flops(n.forward.total), _flops(n.backward.total),
             format_bytes(n.activation_bytes), format_bytes(n.output_bytes)] for n in nodes]
    # too narrow: names and paths shortened in the middle, then kind, dtype, new bytes, shape left out
    return fit_table(["node", "op", "module", "shape", "dtype", "kind", "forward", "backward", "saved",
                      "new bytes"], rows, width, text_columns=(0, 1, 2), optional=(5, 4, 9, 3, 8),
                     colalign=("left",) * 6 + ("right",) * 4)


def unsupported_footer(p: Profile) -> str:
    a = p.accounting
    missing = uncosted_ops(p)
    if missing is None:
        return f"every op has a cost formula ({a.node_count:,} op nodes)"
    count, ops = missing
    return (f"WARNING: {len(a.unsupported_ops)} op(s) without a cost formula, their FLOPs not counted: "
            f"{count} of {a.node_count:,} op nodes ({100 * count / max(1, a.node_count):.1f}%): {ops}")


def render_text(p: Profile, depth: int = DEFAULT_DEPTH, top: int = DEFAULT_TOP, width: int | None = None) -> str:
    parts = [summary(p), "", render_memory(p), "",
             f"modules (depth {depth}, inclusive):", modules_table(p, depth, width), ""]
    if p.checkpoint is not None:
        parts += [checkpoint_section(p.checkpoint), ""]
    if p.compiled is not None:
        parts += [compile_section(p.compiled), ""]
    if top > 0:
        parts += [f"top {top} node{'s' if top != 1 else ''} by forward+backward FLOPs:", nodes_table(p, top, width),
                  ""]
    parts.append(unsupported_footer(p))
    return "\n".join(parts) + "\n"


__all__ = ["render_text", "render_profile_text", "DEFAULT_DEPTH", "DEFAULT_TOP", "summary", "modules_table", "nodes_table", "unsupported_footer",
           "MATMUL", "ATTENTION", "OTHER"]


def render_profile_text(p: Profile, depth: int = DEFAULT_DEPTH, top: int = DEFAULT_TOP, prediction=None, runtime=None,
                        width: int | None = None, summary_only: bool = False) -> str:
    """The one-screen summary (fxacct.report.summary_text), then (unless ``summary_only``) render_text,
    the predicted step time (fxacct.predict.roofline) and, after --runtime, the comparison of
    predicted and measured (fxacct.report.runtime_text; under ``summary_only`` its whole-step part
    alone). Tables fit ``width`` and prose wraps at it (None: no limit)."""
    parts = [render_summary(p, prediction, width)]
    if p.warnings:  # what makes the numbers less than exact: under --summary too
        parts += ["", *(f"WARNING: {w}" for w in p.warnings)]
    if summary_only:
        if runtime is not None:  # what the run measured of the whole step; its modules and nodes are the table's
            parts += ["", "\n".join(runtime_headline(runtime))]
    else:
        parts += ["", render_text(p, depth=depth, top=top, width=width).rstrip("\n"), "",
                  predicted_section(prediction)]
        if p.parallel is not None:
            parts += ["", render_collectives(p.parallel, width)]
        if runtime is not None:
            parts += ["", runtime_section(runtime, depth=depth, top=top, width=width)]
    return wrap_lines("\n".join(parts), width) + "\n"
