"""`fxacct diff --format markdown`: the budgets' verdict first, then the change tables (before,
after, Δ, %) of the totals and of the modules that changed most, for a pull-request comment."""

from __future__ import annotations

from fxacct.report.diff_text import _delta, _num, _ratio, config_note
from fxacct.report.markdown import ROOT, pipe_table
from fxacct.tools.diff import DiffResult

CHANGE_HEADERS = ["before", "after", "Δ", "%"]


def verdict(result: DiffResult) -> str:
    if not result.budgets:
        return "**fxacct diff**: no budgets given (`--max-increase KEY=PCT`)"
    failed = [b.change.key for b in result.budgets if not b.ok]
    if failed:
        return (f"**fxacct diff: FAILED**, {len(failed)} of {len(result.budgets)} budget(s) over: "
                + ", ".join(f"`{k}`" for k in failed))
    return f"**fxacct diff: ok**, all {len(result.budgets)} budget(s) hold"


def budgets_table(result: DiffResult) -> str:
    rows = [[f"`{b.change.key}`", _num(b.change.old), _num(b.change.new), _delta(b.change), _ratio(b.change),
             f"+{float(b.max_percent):g}%", "ok" if b.ok else "**OVER**"] for b in result.budgets]
    return pipe_table(["budget", *CHANGE_HEADERS, "allowed", "status"], rows,
                      ("left", "right", "right", "right", "right", "right", "left"))


def totals_table(result: DiffResult) -> str:
    rows = [[f"`{c.key}`", _num(c.old), _num(c.new), _delta(c), _ratio(c)] for c in result.totals]
    return pipe_table(["total", *CHANGE_HEADERS], rows, ("left", "right", "right", "right", "right"))


def modules_table(result: DiffResult) -> str:
    rows = [[f"`{m.module}`" if m.module else ROOT, m.status, _num(m.flops.old), _num(m.flops.new),
             _delta(m.flops), _ratio(m.flops), _delta(m.activation_bytes)] for m in result.modules]
    return pipe_table(["module", "status", "FLOPs before", "FLOPs after", "Δ FLOPs", "%", "Δ activation bytes"],
                      rows, ("left", "left", "right", "right", "right", "right", "right"))


def render_diff_markdown(result: DiffResult, old_path: str, new_path: str) -> str:
    parts = [verdict(result), ""]
    if result.budgets:
        parts += [budgets_table(result), ""]
    note = " (different models)" if result.old_model != result.new_model else ""
    parts += [f"#### Totals: `{old_path}` → `{new_path}`{note}", ""]
    if result.config_changes:
        parts += [f"Note: {config_note(result)}", ""]
    parts += [totals_table(result), ""]
    if result.modules:
        parts += [f"#### Modules that changed most ({len(result.modules)} of {result.modules_changed} changed; "
                  "FLOPs forward+backward, inclusive)", "", modules_table(result)]
    elif result.modules_changed:  # --top 0: none shown, but they did change
        parts.append(f"{result.modules_changed} module(s) changed their FLOPs or activations (--top 0 shows none).")
    else:
        parts.append("No module changed its FLOPs or activations.")
    return "\n".join(parts).rstrip("\n") + "\n"


__all__ = ["render_diff_markdown", "verdict"]
