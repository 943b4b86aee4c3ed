"""`fxacct profile --format markdown`: the summary, the totals and the per-module (or per-node)
table, with thousands separators and units, ready to post as a pull-request comment (GitHub
flavoured pipe tables, numbers right-aligned)."""

from __future__ import annotations

from fxacct.report.collectives import render_collectives
from fxacct.report.durations import format_ms
from fxacct.report.summary_text import exact_bytes, facts
from fxacct.report.tables import tabulate
from fxacct.report.text import DEFAULT_DEPTH
from fxacct.step import Profile
from fxacct.units import format_bytes

ROOT = "(root)"  # the root module's name in every table (its FQN is "")


def cell(text) -> str:
    """A table cell: '|' escaped so it cannot split the row."""
    return str(text).replace("|", "\\|")


def pipe_table(headers, rows, align) -> str:
    return tabulate([[cell(c) for c in r] for r in rows], headers=[cell(h) for h in headers], tablefmt="pipe",
                    colalign=align)


def flops(n: int) -> str:
    return f"{n:,}"


def totals_table(p: Profile, prediction=None) -> str:
    return pipe_table(["total", "value"], totals_rows(p, prediction), ("left", "right"))


def totals_rows(p: Profile, prediction=None) -> list[list[str]]:
    """[label, value] of the totals: the markdown table's and the HTML page's static table."""
    t, m = p.accounting.totals, p.memory
    rank = " (per rank)" if p.parallel is not None else ""  # rank 0's shard under --mesh
    rows = [["forward FLOPs", flops(t.forward.total)], ["backward FLOPs", flops(t.backward.total)],
            ["forward + backward FLOPs", flops(t.forward.total + t.backward.total)],
            ["loss FLOPs (not in the above)", flops(t.loss_flops)],
            ["parameters" + rank, f"{t.params:,}"], ["trainable parameters" + rank, f"{t.trainable_params:,}"],
            ["parameter bytes" + rank, exact_bytes(t.param_bytes)], ["gradient bytes" + rank, exact_bytes(t.grad_bytes)],
            ["optimizer state bytes" + rank, exact_bytes(m.optimizer_bytes)],
            ["activations saved for backward" + rank, exact_bytes(t.activation_bytes)]]
    if t.loss_activation_bytes:
        rows.append(["of them saved by the loss", exact_bytes(t.loss_activation_bytes)])
    if p.parallel is not None and p.parallel.model_params:
        rows.insert(6, ["parameters (the whole model)", f"{p.parallel.model_params:,}"])
    if m.rank_peak is not None:
        rows.append(["training peak" + (" per rank" if m.per_rank is not None or rank else ""),
                     exact_bytes(m.rank_peak.bytes)])
    if m.peak_inference is not None:
        rows.append(["inference peak", exact_bytes(m.peak_inference.bytes)])
    if prediction is not None:
        rows.append([f"predicted step time ({prediction.device.name})", format_ms(prediction.step_ms)])
    return rows


def modules_table(p: Profile, depth: int | None = None) -> str:
    t = p.accounting.totals
    grand = max(1, t.forward.total + t.backward.total)
    rows = [[f"`{m.module}`" if m.module else ROOT, flops(m.forward.total), flops(m.backward.total),
             f"{100 * (m.forward.total + m.backward.total) / grand:.1f}%", format_bytes(m.activation_bytes)]
            for m in p.accounting.modules if depth is None or m.depth <= depth]
    return pipe_table(["module", "forward FLOPs", "backward FLOPs", "share", "activations"], rows,
                      ("left", "right", "right", "right", "right"))


def nodes_table(p: Profile) -> str:
    rows = [[f"`{n.name}`", f"`{n.op}`", f"`{n.module}`" if n.module else ROOT, "×".join(map(str, n.shape)),
             n.dtype or "", n.kind, flops(n.forward.total), flops(n.backward.total),
             format_bytes(n.activation_bytes), format_bytes(n.output_bytes)] for n in p.accounting.nodes]
    return pipe_table(["node", "op", "module", "shape", "dtype", "kind", "forward FLOPs", "backward FLOPs", "saved",
                       "new bytes"], rows, ("left",) * 6 + ("right",) * 4)


def render_summary_markdown(p: Profile, prediction=None) -> str:
    return "\n".join(f"- **{k}**: {cell(v)}" for k, v in facts(p, prediction))


def render_markdown(p: Profile, prediction=None, by: str = "module", depth: int | None = DEFAULT_DEPTH,
                    summary_only: bool = False) -> str:
    """The markdown report; its module table shows ``depth`` levels of nesting, the text table's
    default (None: every module)."""
    parts = [f"### fxacct profile: `{p.title}`", "", render_summary_markdown(p, prediction)]
    if p.parallel is not None:  # whose figures these are, the pipeline and the collectives: the text report's

        parts += ["", f"#### Mesh `{p.parallel.mesh}`", "", "```text", render_collectives(p.parallel), "```"]
    if not summary_only:
        parts += ["", "#### Totals", "", totals_table(p, prediction), ""]
        if by == "node":
            parts += ["#### Forward nodes (each with the backward derived from it)", "", nodes_table(p)]
        else:
            scope = "all modules" if depth is None else f"depth {depth}"
            parts += [f"#### Modules ({scope}, inclusive)", "", modules_table(p, depth)]
    return "\n".join(parts) + "\n"


__all__ = ["render_markdown", "render_summary_markdown", "totals_table", "totals_rows", "modules_table", "nodes_table",
           "pipe_table", "cell", "ROOT"]
