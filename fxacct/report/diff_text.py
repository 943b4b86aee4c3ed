"""`fxacct diff` output: totals side by side with their change, the modules that changed most, and
the --max-increase budgets; plain text for a CI log, and a JSON document."""

from __future__ import annotations

from fxacct.report.check_text import plain_number
from fxacct.report.tables import tabulate
from fxacct.tools.diff import Change, DiffResult

DIFF_SCHEMA = "fxacct.diff/1"


def _num(v) -> str:
    if v is None:
        return "-"
    return f"{v:,}" if isinstance(v, int) else f"{v:,.6g}"


def _delta(c: Change) -> str:
    d = c.delta
    if d is None:
        return "-"
    return ("+" if d > 0 else "") + _num(d)


def _ratio(c: Change) -> str:
    if c.delta is None:
        return "-"
    r = c.ratio
    if r is None:
        return "new"  # from 0
    return f"{float(r):+.2%}"


def config_note(result: DiffResult) -> str:
    """The settings that make the two profiles different steps (a mesh rank's totals are its share)."""
    changed = "; ".join(f"{c.key} {c.old if c.old is not None else 'none'} -> {c.new if c.new is not None else 'none'}"
                        for c in result.config_changes)
    return f"the two profiles are of different steps ({changed}): their totals differ by that too"


def render_diff(result: DiffResult, old_path: str, new_path: str) -> str:
    lines = [f"fxacct diff: {old_path} ({result.old_model}) -> {new_path} ({result.new_model})"]
    if result.old_model != result.new_model:
        lines.append("note: the two profiles are of different models")
    if result.config_changes:
        lines.append(f"note: {config_note(result)}")
    lines.append("")
    rows = [[c.key, _num(c.old), _num(c.new), _delta(c), _ratio(c)] for c in result.totals]
    lines += [tabulate(rows, headers=["totals", "old", "new", "change", "change %"],
                       colalign=("left", "right", "right", "right", "right")), ""]
    if result.modules:
        rows = [[m.module or "(root)", m.status, _num(m.flops.old), _num(m.flops.new), _ratio(m.flops),
                 _delta(m.activation_bytes)] for m in result.modules]
        lines += [f"modules that changed most ({len(result.modules)} of {result.modules_changed} changed; "
                  "FLOPs are forward+backward, inclusive):",
                  tabulate(rows, headers=["module", "status", "old FLOPs", "new FLOPs", "change %",
                                          "activation bytes change"],
                           colalign=("left", "left", "right", "right", "right", "right")), ""]
    elif result.modules_changed:  # --top 0: none shown, but they did change
        lines += [f"{result.modules_changed} module(s) changed their FLOPs or activations (--top 0 shows none)", ""]
    else:
        lines += ["no module changed its FLOPs or activations", ""]
    if result.budgets:
        rows = [[b.change.key, _num(b.change.old), _num(b.change.new), _ratio(b.change),
                 f"+{float(b.max_percent):g}%", "ok" if b.ok else "OVER"] for b in result.budgets]
        lines += [tabulate(rows, headers=["budget", "old", "new", "change %", "allowed", "status"],
                           colalign=("left", "right", "right", "right", "right", "left")), ""]
        failed = [b.change.key for b in result.budgets if not b.ok]
        lines.append(f"FAILED: {len(failed)} of {len(result.budgets)} budget(s) over ({', '.join(failed)})"
                     if failed else f"ok: all {len(result.budgets)} budget(s) hold")
    return "\n".join(lines).rstrip("\n") + "\n"


def _change(c: Change) -> dict:
    r = c.ratio
    return {"key": c.key, "old": c.old, "new": c.new, "change": c.delta,
            "change_fraction": None if r is None else float(r)}


def diff_document(result: DiffResult, old_path: str, new_path: str) -> dict:
    return {
        "schema": DIFF_SCHEMA, "profile_schema": result.schema, "ok": result.ok,
        "old": {"file": old_path, "model": result.old_model}, "new": {"file": new_path, "model": result.new_model},
        "totals": [_change(c) for c in result.totals],
        "modules": [{"module": m.module, "status": m.status, "flops": _change(m.flops),
                     "activation_bytes": _change(m.activation_bytes)} for m in result.modules],
        "modules_changed": result.modules_changed,
        "config_changes": [{"key": c.key, "old": c.old, "new": c.new} for c in result.config_changes],
        "budgets": [{**_change(b.change), "max_increase_percent": plain_number(b.max_percent), "ok": b.ok}
                    for b in result.budgets],
    }
